"""Sparse upcycling: every expert starts as a copy of the dense FFN it replaces.

Shapes: E experts (local), D model dim, F ffn dim.
With top_k >= 2 (gates renormalised to sum to 1) and no drops, each token's output is
sum_k g_k * FFN(x) = FFN(x): the swapped model computes the dense model's function until
training moves the experts apart. top_k=1 with one expert gives gate 1 as well. top_k=1 with
E > 1 scales the output by the router probability p_e (Switch), so it is close, not equal.
"""
import torch
import torch.nn as nn

from .adapters.base import DenseWeights


def _copy_into(param, src, name: str) -> None:
    """param [E, ...] <- src [...] repeated over experts, after checking the shape."""
    if (param is None) != (src is None):
        have = "has" if param is not None else "lacks"
        raise ValueError(f"upcycling: the MoE layer {have} {name} but the dense FFN "
                         f"{'does not' if src is None else 'does'}; check expert_bias/activation")
    if param is None:
        return
    if tuple(param.shape[1:]) != tuple(src.shape):
        raise ValueError(f"upcycling: {name} of the experts is {tuple(param.shape[1:])} per "
                         f"expert but the dense weight is {tuple(src.shape)}")
    param.copy_(src.to(param.dtype).unsqueeze(0).expand_as(param))


@torch.no_grad()
def upcycle_layer(moe, dense: DenseWeights, router_init_std: float = 1e-3) -> None:
    """Copy `dense` into every expert of `moe`; small random router; zero shared-expert output.

    The router is small so the first routing decisions are close to uniform and gates do not
    saturate; a shared expert (if any) gets a zero output projection so it starts as a no-op
    and the upcycled layer still equals the dense FFN.
    """
    bank = moe.experts
    for name in ("w1", "w2", "w3", "b1", "b2", "b3"):
        src = getattr(dense, {"w1": "w1_DF", "w2": "w2_FD", "w3": "w3_DF", "b1": "b1_F",
                              "b2": "b2_D", "b3": "b3_F"}[name])
        _copy_into(getattr(bank, name), src, f"experts.{name}")
    nn.init.normal_(moe.router.weight, std=router_init_std)
    if moe.shared_experts is not None:
        moe.shared_experts.bank.w2.zero_()
        if moe.shared_experts.bank.b2 is not None:
            moe.shared_experts.bank.b2.zero_()
