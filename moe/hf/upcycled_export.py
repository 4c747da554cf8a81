"""Which transformers MoE architecture computes the same function as an upcycled dense model.

Mixtral's block: softmax router (fp32), top-k, the k gates renormalised, swiglu experts,
no shared expert, dropless, in every layer. Qwen2-MoE's: the same with norm_topk_prob
either way, a sparse block every decoder_sparse_step layers, and a shared expert scaled by
sigmoid(shared_expert_gate(x)). A moefied Llama or Mistral whose layers fit the first is
written as Mixtral, a moefied Qwen2 fitting the second as Qwen2-MoE; every mismatch is named.
Both targets compute the router scores in fp32: for fp32/bf16 models that is moekit's
default too; an fp64 model matches them exactly when moefied with score_dtype="float32".
"""
from dataclasses import dataclass

import torch

from ..quiet import transformers_quietly
from .convert import wrapped_layers

FALLBACK = ("save it with model.save_pretrained(dir) and reload it with "
            "moe.hf.load_moefied(dir), which keeps every moekit option")
_TARGETS = {"llama": "mixtral", "mistral": "mixtral", "qwen2": "qwen2_moe"}


@dataclass(frozen=True)
class Target:
    config: object   # the transformers config of the MoE architecture
    shared: str      # "none" (Mixtral), "gated" (our gated shared expert), "zero" (Qwen2-MoE, none of ours)


def _layers(model):
    return [moe for _, moe in wrapped_layers(model)]


def _mismatch(moe, target: str) -> list:
    """What keeps this MoELayer from being a `target` block (empty: it fits)."""
    r = moe.router.config
    checks = [
        (moe.experts.activation == "swiglu", f"activation={moe.experts.activation!r} (needs 'swiglu')"),
        (moe.experts.b1 is None, "expert_bias=True"),
        (r.kind == "token_choice", f"router={r.kind!r}"),
        (r.score_func == "softmax", f"score_func={r.score_func!r}"),
        (r.n_group == 1, f"n_group={r.n_group}"),
        (r.routed_scaling_factor == 1.0, f"routed_scaling_factor={r.routed_scaling_factor}"),
        (not r.router_bias, "router_bias=True"),
        (r.logits_dtype is None and r.score_dtype in (None, torch.float32),
         "router dtypes other than the default or score_dtype='float32'"),
        (not moe.router.selection_bias.any(), "a non-zero selection bias"),
        (moe.capacity_factor is None and moe.eval_capacity_factor is None
         and r.expert_capacity is None, "a capacity limit (the target is dropless)"),
    ]
    if target == "mixtral":
        checks += [(r.norm_topk_prob, "gates not renormalised (norm_topk_prob=False, or top_k=1 "
                                      "with the default; Mixtral renormalises for any k)"),
                   (moe.shared_experts is None, "shared experts")]
    elif moe.shared_experts is not None:
        checks += [(moe.shared_experts.gate is not None,
                    "shared experts without shared_expert_gate=True")]
    return [why for ok, why in checks if not ok]


def _common(cfg) -> dict:
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range",
            "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
            "tie_word_embeddings", "rope_parameters", "attention_dropout", "dtype")
    return {k: getattr(cfg, k) for k in keys if hasattr(cfg, k)}


def target_for(model, section: dict) -> Target:
    transformers = transformers_quietly()
    family, cfg = section["family"], model.config
    target = _TARGETS.get(family)
    if target is None:
        raise ValueError(f"an upcycled {family} model has no transformers MoE architecture with "
                         f"the same function (save_hf exports llama/mistral -> mixtral and "
                         f"qwen2 -> qwen2_moe); {FALLBACK}")
    layers = _layers(model)
    problems = {i: _mismatch(m, target) for i, m in enumerate(layers)}
    problems = {i: p for i, p in problems.items() if p}
    if problems:
        i, p = next(iter(problems.items()))
        raise ValueError(f"the upcycled {family} model cannot be written as {target}: MoE layer {i} "
                         f"has {', '.join(p)}; {FALLBACK}")
    if getattr(cfg, "attention_bias", False):
        raise ValueError(f"{family} with attention_bias=True has no {target} equivalent; {FALLBACK}")
    moe = layers[0]
    arch = type(model).__name__
    if target == "mixtral":
        if section["every"] != 1:
            raise ValueError(f"moefy(every={section['every']}) left dense FFNs, and every Mixtral "
                             f"layer is sparse; {FALLBACK}")
        new = transformers.MixtralConfig(
            **_common(cfg), head_dim=getattr(cfg, "head_dim", None),
            sliding_window=getattr(cfg, "sliding_window", None),
            intermediate_size=moe.d_ff, num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coef,
            router_jitter_noise=moe.router.config.jitter)
        new.architectures = [arch.replace("Llama", "Mixtral").replace("Mistral", "Mixtral")]
        return Target(new, "none")
    extra = {k: getattr(cfg, k) for k in ("use_sliding_window", "sliding_window",
                                           "max_window_layers", "layer_types") if hasattr(cfg, k)}
    shared = moe.shared_experts
    new = transformers.Qwen2MoeConfig(
        **_common(cfg), **extra, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=moe.d_ff, num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, norm_topk_prob=moe.router.config.norm_topk_prob,
        decoder_sparse_step=section["every"], mlp_only_layers=[],
        shared_expert_intermediate_size=1 if shared is None else shared.bank.w1.shape[-1],
        router_aux_loss_coef=moe.aux_loss_coef, qkv_bias=True)
    new.architectures = [arch.replace("Qwen2", "Qwen2Moe")]
    return Target(new, "zero" if shared is None else "gated")
