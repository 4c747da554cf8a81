"""A transformers config.json read as the sizes of moekit's own GPT (`hf.config = PATH`).

Nothing is downloaded and no weights are read: the file gives the architecture, moekit builds
its own GPT with it (freshly initialised for train.py, on the meta device for the planner),
so every layout (tp, cp, pp, ep, etp, ZeRO) applies to it. The values set here are defaults:
anything the TOML or the command line sets in [model] / [moe] wins (trainer/config.py), so a
user can train a small model with the architecture of a famous one.

Families (config.json "model_type"):
  llama, mistral, qwen3         dense: GQA (num_key_value_heads), head_dim, qk_norm (qwen3)
  mixtral                       every layer MoE, softmax top-k renormalised
  qwen3_moe                     MoE every decoder_sparse_step layers, qk_norm
  deepseek_v3                   MLA; first_k_dense_replace dense layers, then MoE with one
                                shared expert, sigmoid group-limited routing, bias-based
                                (aux-loss-free) balancing and a small sequence-wise loss
What is not reproduced, and said where it matters: a YaRN-scaled rotary (rope_scaling:
plain RoPE at rope_theta), DeepSeek-V3's multi-token-prediction module
(num_nextn_predict_layers; transformers' model has none either), sliding windows.
"""
import json
import os

FAMILIES = ("llama", "mistral", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")

# DeepSeek-V3 technical report (arXiv 2412.19437, section 2.1.2 and 4.2): bias update speed
# gamma = 0.001 for the aux-loss-free balancing
_DEEPSEEK_BIAS_RATE = 0.001


def read_hf_config(path: str) -> dict:
    """The dict of a config.json file (or of DIR/config.json); ValueError naming hf.config."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"hf.config={path!r} is not a config.json file (or a directory holding "
                         f"one); point it at a transformers config.json, e.g. "
                         f"configs/models/hf/mixtral_8x7b.json")
    try:
        with open(file) as f:
            out = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"hf.config={path!r} is not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"hf.config={path!r} holds a JSON {type(out).__name__}, not the object of "
                         f"a transformers config.json")
    return out


def gpt_sections(hf: dict, where: str = "hf.config") -> dict:
    """{"model": {...}, "moe": {...}}: the [model] and [moe] values of this architecture."""
    family = hf.get("model_type", "")
    if family not in FAMILIES:
        raise ValueError(f"{where}: model_type={family!r} is not one moekit can rebuild; use a "
                         f"config.json of {', '.join(FAMILIES)}")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{where}: attention_bias/mlp_bias=true is not rebuilt (moekit's "
                         f"model.bias puts biases on every linear); use a config without them")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={hf.get('hidden_act')!r}; only silu (SwiGLU) "
                         f"families are rebuilt")
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    model = dict(arch="gpt", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
                 n_layers=hf["num_hidden_layers"], n_heads=heads,
                 n_kv_heads=0 if kv == heads else kv, d_ff=hf["intermediate_size"],
                 max_seq_len=hf.get("max_position_embeddings", 4096), dropout=0.0,
                 positions="rope", rope_theta=_rope_theta(hf),
                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)), norm="rmsnorm",
                 norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu", bias=False,
                 init_std=float(hf.get("initializer_range", 0.02)),
                 head_dim=_head_dim(hf), qk_norm=family in ("qwen3", "qwen3_moe"))
    if family == "deepseek_v3":
        model.update(attention="mla", n_kv_heads=0, q_lora_rank=hf.get("q_lora_rank") or 0,
                     kv_lora_rank=hf["kv_lora_rank"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                     head_dim=hf["qk_nope_head_dim"], v_head_dim=hf["v_head_dim"])
    return {"model": model, "moe": _moe(family, hf, where)}


def deepseek_v3_config(hf: dict, model_cfg, moe_cfg) -> dict:
    """The deepseek_v3 config.json `hf` with the sizes of [model] / [moe] written back (the
    inverse of gpt_sections' deepseek_v3 branch: a TOML or the command line may have
    overridden them), for a checkpoint of a run (commands/export_hf.py)."""
    m, e = model_cfg, moe_cfg
    return dict(hf, vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.n_layers,
                num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
                intermediate_size=m.d_ff, q_lora_rank=m.q_lora_rank or None,
                kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
                qk_nope_head_dim=m.head_dim, v_head_dim=m.v_head_dim or m.head_dim,
                moe_intermediate_size=e.d_ff or m.d_ff, n_routed_experts=e.num_experts,
                num_experts_per_tok=e.top_k, first_k_dense_replace=e.first_moe_layer,
                n_shared_experts=e.num_shared_experts, n_group=e.n_group, topk_group=e.topk_group,
                routed_scaling_factor=e.routed_scaling_factor, norm_topk_prob=e.norm_topk_prob,
                max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps,
                tie_word_embeddings=m.tie_embeddings)


def _rope_theta(hf: dict) -> float:
    """Top-level rope_theta (the published files), or inside rope_parameters (transformers 5)."""
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta")
    return float(theta or 10000.0)


def _head_dim(hf: dict) -> int:
    hd = hf.get("head_dim") or 0
    return 0 if hd * hf["num_attention_heads"] == hf["hidden_size"] else hd


def _moe(family: str, hf: dict, where: str) -> dict:
    common = dict(capacity_factor=None, z_loss_coef=0.0, jitter=0.0)
    if family in ("llama", "mistral", "qwen3"):
        return dict(every=0)
    if family == "mixtral":
        return dict(common, num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                    every=1, d_ff=0, norm_topk_prob=True,
                    aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.02)))
    if family == "qwen3_moe":
        if hf.get("mlp_only_layers"):
            raise ValueError(f"{where}: mlp_only_layers={hf['mlp_only_layers']} is not rebuilt "
                             f"(moekit places MoE layers by moe.every / moe.first_moe_layer)")
        return dict(common, num_experts=hf.get("num_experts") or hf["num_local_experts"],
                    top_k=hf["num_experts_per_tok"], every=hf.get("decoder_sparse_step", 1), d_ff=hf["moe_intermediate_size"],
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    # deepseek_v3
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{where}: moe_layer_freq={hf['moe_layer_freq']} is not rebuilt; use 1")
    return dict(common, num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
                every=1, first_moe_layer=hf.get("first_k_dense_replace", 0),
                d_ff=hf["moe_intermediate_size"], num_shared_experts=hf.get("n_shared_experts") or 0,
                score_func=hf.get("scoring_func", "sigmoid"),
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 0,
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                bias_update_rate=_DEEPSEEK_BIAS_RATE if hf.get("topk_method", "noaux_tc") == "noaux_tc" else 0.0,
                aux_loss_coef=float(hf.get("aux_loss_alpha", 0.0)) if hf.get("seq_aux", True) else 0.0)
