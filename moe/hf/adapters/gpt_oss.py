"""GPT-OSS: `model.layers[i].mlp` (GptOssMLP: `router` with bias, interleaved biased experts).

Routing in the model's dtype: logits = x @ W.T + b, top-k of the logits, gates = softmax over
the k chosen logits (= the renormalised top-k of the full softmax). Experts store [in, out]:
gate_up_proj [E, D, 2F] with gate and up interleaved (columns 0, 2, 4, ... are the gate),
gate_up_proj_bias [E, 2F], down_proj [E, F, D], down_proj_bias [E, D]; the activation is
the clamped SwiGLU with config.swiglu_alpha/limit (moe/activations.py). The block returns
(hidden_states, router_scores) and the decoder layer unpacks it, so the swapped module
returns (hidden_states, None).
"""
import torch

from .base import find_sites
from .hf_moe import TupleMoEFFN


def _is_block(m) -> bool:
    e = getattr(m, "experts", None)
    return isinstance(getattr(e, "gate_up_proj_bias", None), torch.Tensor) and isinstance(
        getattr(getattr(m, "router", None), "bias", None), torch.Tensor)


class GptOssAdapter:
    family = "gpt_oss"
    model_types = ("gpt_oss",)
    kind = "moe"
    selection_bias = None  # no aux-loss-free selection bias in these checkpoints

    def sites(self, model):
        return find_sites(model, "mlp", _is_block)

    def layer_kwargs(self, config, block) -> dict:
        E, D, two_F = block.experts.gate_up_proj.shape
        return {"d_model": D, "d_ff": two_F // 2, "num_experts": E,
                "top_k": config.num_experts_per_tok, "activation": "clamped_swiglu",
                "swiglu_alpha": float(config.swiglu_alpha),
                "swiglu_limit": float(config.swiglu_limit), "expert_bias": True,
                "router_bias": True, "norm_topk_prob": True}

    @torch.no_grad()
    def load(self, block, moe) -> None:
        e, bank = block.experts, moe.experts
        bank.w1.copy_(e.gate_up_proj[..., 0::2])
        bank.w3.copy_(e.gate_up_proj[..., 1::2])
        bank.b1.copy_(e.gate_up_proj_bias[..., 0::2])
        bank.b3.copy_(e.gate_up_proj_bias[..., 1::2])
        bank.w2.copy_(e.down_proj)
        bank.b2.copy_(e.down_proj_bias)
        moe.router.weight.copy_(block.router.weight)
        moe.router.bias.copy_(block.router.bias)

    def install(self, site, moe) -> None:
        site.owner.mlp = TupleMoEFFN(moe)

    def export(self, moe) -> dict:
        bank = moe.experts
        E, D, F = bank.w1.shape
        gate_up = torch.stack([bank.w1, bank.w3], dim=-1).reshape(E, D, 2 * F)
        gate_up_bias = torch.stack([bank.b1, bank.b3], dim=-1).reshape(E, 2 * F)
        return {"router.weight": moe.router.weight, "router.bias": moe.router.bias,
                "experts.gate_up_proj": gate_up, "experts.gate_up_proj_bias": gate_up_bias,
                "experts.down_proj": bank.w2, "experts.down_proj_bias": bank.b2}


ADAPTER = GptOssAdapter()
