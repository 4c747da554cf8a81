"""Switch Transformers: `...layer[-1].mlp` (SwitchTransformersSparseMLP) in the sparse blocks.

Routing: the router casts its input to config.router_dtype (fp32) before the classifier
(optional bias, config.router_bias), softmax, top-1; the gate is the raw probability; each
expert takes at most config.expert_capacity tokens per sequence, first come first served,
in training and eval (dropped tokens give zero, the residual carries them). Experts:
ModuleDict expert_i with wi [F, D] -> act -> (dropout) -> wo [D, F]; the dropout between the
projections has no place inside moekit's experts and is left out (eval is identical).
"""
import torch

from .base import MoEFFN, find_sites, map_activation


def _is_block(m) -> bool:
    return hasattr(getattr(m, "router", None), "classifier") and hasattr(
        getattr(m, "experts", None), "expert_0")


def _stack(name: str) -> str:
    return "decoder" if name.startswith("decoder.") or ".decoder." in name else "encoder"


class SwitchAdapter:
    family = "switch_transformers"
    model_types = ("switch_transformers",)
    kind = "moe"
    selection_bias = None  # no aux-loss-free selection bias in these checkpoints

    def sites(self, model):
        return find_sites(model, "mlp", _is_block, _stack)

    def layer_kwargs(self, config, block) -> dict:
        F, D = block.experts.expert_0.wi.weight.shape
        return {"d_model": D, "d_ff": F, "num_experts": config.num_experts, "top_k": 1,
                "activation": map_activation(config.dense_act_fn, False, "config.dense_act_fn"),
                "norm_topk_prob": False, "logits_dtype": config.router_dtype,
                "router_bias": bool(config.router_bias), "expert_capacity": config.expert_capacity,
                "jitter": float(config.router_jitter_noise or 0.0),
                "aux_loss_coef": config.router_aux_loss_coef,
                "z_loss_coef": config.router_z_loss_coef}

    @torch.no_grad()
    def load(self, block, moe) -> None:
        bank = moe.experts
        for e in range(bank.num_local):
            expert = block.experts[f"expert_{e}"]
            bank.w1[e].copy_(expert.wi.weight.t())
            bank.w2[e].copy_(expert.wo.weight.t())
        moe.router.weight.copy_(block.router.classifier.weight)
        if moe.router.bias is not None:
            moe.router.bias.copy_(block.router.classifier.bias)

    def install(self, site, moe) -> None:
        site.owner.mlp = MoEFFN(moe)

    def export(self, moe) -> dict:
        out = {"router.classifier.weight": moe.router.weight}
        if moe.router.bias is not None:
            out["router.classifier.bias"] = moe.router.bias
        for e in range(moe.experts.num_local):
            out[f"experts.expert_{e}.wi.weight"] = moe.experts.w1[e].t()
            out[f"experts.expert_{e}.wo.weight"] = moe.experts.w2[e].t()
        return out


ADAPTER = SwitchAdapter()
