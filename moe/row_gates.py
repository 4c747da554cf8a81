"""The routing gates applied inside the experts (moe.gates_in_experts): each dispatched row's
gate scales its expert's hidden activation before the output projection, and the combine is
a plain sum of a token's rows that keeps nothing for backward.

Shapes: N dispatched rows, n rows of one expert, F ffn dim, D model dim.

    y_token = sum_k g_k (a_k W2 + b2) = sum_k (g_k a_k) W2 + g_k b2

The same function as weighting the expert outputs in the combine (moe/dispatcher.py
weighted_combine), rounded at another point. The gate's gradient is
<dy, a W2 + b2> = <dy W2^T, a> + <dy, b2>: it is taken on the expert side from the hidden a,
which the experts keep for W2's gradient anyway (or compute again under moe_act), instead of
from the expert output [N, D] the weighted combine has to keep: one D-wide row less per
routed assignment (Megatron-Core applies its router probabilities in the experts' activation
for the same reason). Under expert parallelism the gates travel to the experts beside the
rows (fp32, one all-to-all each way: moe/ep_dispatcher.py FLAT_GATE_CALLS).

`weighted` and `weighted_backward` are the gated hidden forward and backward for every expert
path: for the gated activations one fused op each way (moekit::weighted_gated_act and its
backward: one kernel each on CUDA, moe/fusion.py), the backward computing the activation
again from h1, h3 (never kept) and handing out the gate's gradient and the gated hidden W2's
gradient needs. The fused expert paths (moe/experts.py _GroupedFFN, moe/grouped_mm.py
_GroupedMMFFN) so keep only the pre-activations and the gates; `weighted_act` is the autograd
piece of the composed paths (plain ops, FP8), whose following GEMM keeps its gated input.
"""
import torch

from .activations import _gated_backward, _gated_forward
from .fusion import is_plain, run_fused
from .dtypes import accumulation_dtype

__all__ = ["weighted", "weighted_backward", "weighted_act", "gate_column", "gate_bias_grad",
           "add_gated_bias"]


def gate_column(g_n: torch.Tensor, dtype) -> torch.Tensor:
    """[n] gates as an [n, 1] column in the hidden's dtype (the weighted combine casts its
    gates to the rows' dtype the same way)."""
    return g_n.to(dtype).unsqueeze(1)


def _weighted_gated(name: str, h1, h3, g, alpha: float, limit: float):
    return _gated_forward(name, h1, h3, alpha, limit) * gate_column(g, h1.dtype)


def _gate_parts(dag, a, g) -> tuple:
    """(the gate's gradient <dag, a>, the gradient through the gate dag g, the gated hidden
    a g) of a gated hidden's gradient dag, a the hidden before its gate."""
    col = gate_column(g, a.dtype)
    return (dag * a).sum(-1, dtype=accumulation_dtype(a.dtype)), dag * col, a * col


def _weighted_gated_backward(name: str, dag, h1, h3, g, alpha: float, limit: float):
    dg, da, ag = _gate_parts(dag, _gated_forward(name, h1, h3, alpha, limit), g)
    dh1, dh3 = _gated_backward(name, da, h1, h3, alpha, limit)
    return dh1, dh3, dg, ag


@torch.library.custom_op("moekit::weighted_gated_act", mutates_args=())
def weighted_gated_act(name: str, h1: torch.Tensor, h3: torch.Tensor, g: torch.Tensor,
                       alpha: float, limit: float) -> torch.Tensor:
    return run_fused(_weighted_gated, h1, name, h1, h3, g, alpha, limit)


@torch.library.custom_op("moekit::weighted_gated_act_backward", mutates_args=())
def weighted_gated_act_backward(name: str, dag: torch.Tensor, h1: torch.Tensor, h3: torch.Tensor,
                                g: torch.Tensor, alpha: float, limit: float
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dh1, dh3, dg, ag = run_fused(_weighted_gated_backward, h1, name, dag, h1, h3, g, alpha, limit)
    return dh1.contiguous(), dh3.contiguous(), dg.contiguous(), ag.contiguous()


@weighted_gated_act.register_fake
def _(name, h1, h3, g, alpha, limit):
    return torch.empty_like(h1)


@weighted_gated_act_backward.register_fake
def _(name, dag, h1, h3, g, alpha, limit):
    return (torch.empty_like(h1), torch.empty_like(h3),
            h1.new_empty(h1.shape[0], dtype=accumulation_dtype(h1.dtype)), torch.empty_like(h1))


def _fused(act, *tensors) -> bool:
    return act.gated and all(is_plain(t) for t in tensors)


def weighted(act, h1, h3, g_n):
    """act(h1, h3) with each row scaled by its gate g_n ([n]); no graph kept."""
    if _fused(act, h1, h3, g_n):
        return weighted_gated_act(act.name, h1, h3, g_n, act.alpha, act.limit)
    return act(h1, h3) * gate_column(g_n, h1.dtype)


def weighted_backward(act, dag, h1, h3, g_n) -> tuple:
    """(dh1, dh3 or None, dg [n] in fp32 (fp64 rows: fp64), the gated hidden act(h1, h3) * g)
    for the gradient dag of weighted(act, h1, h3, g_n); the activation is computed again."""
    if _fused(act, dag, h1, h3, g_n):
        return weighted_gated_act_backward(act.name, dag.contiguous(), h1, h3, g_n, act.alpha,
                                           act.limit)
    dg, da, ag = _gate_parts(dag, act(h1, h3), g_n)
    dh1, dh3 = act.backward(da, h1, h3)
    return dh1, dh3, dg, ag


def gate_bias_grad(dy_nD, b2_nD) -> torch.Tensor:
    """The output bias's part of the gate gradient, <dy, b2> per row (b2_nD: each row's
    expert's bias)."""
    return (dy_nD * b2_nD.to(dy_nD.dtype)).sum(-1, dtype=accumulation_dtype(dy_nD.dtype))


def add_gated_bias(y_ND: torch.Tensor, b2_ND: torch.Tensor, g_N: torch.Tensor) -> torch.Tensor:
    """y + g * b2 (differentiable in all three): the output bias of each row's expert, weighted
    by the row's gate like the rest of its output; b2_ND holds each row's expert's bias."""
    return y_ND + gate_column(g_N, y_ND.dtype) * b2_ND.to(y_ND.dtype)


class _WeightedAct(torch.autograd.Function):
    """weighted(act, h1, h3, g), keeping h1 (h3) and g; backward computes the activation
    again (the GEMM after it keeps the gated hidden for its own weight gradient)."""

    @staticmethod
    def forward(ctx, h1, h3, g_N, act):
        ctx.act, ctx.g_dtype = act, g_N.dtype
        ctx.save_for_backward(h1, h3, g_N)
        return weighted(act, h1, h3, g_N)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dag):
        h1, h3, g_N = ctx.saved_tensors
        dh1, dh3, dg, _ = weighted_backward(ctx.act, dag, h1, h3, g_N)
        return dh1, dh3, dg.to(ctx.g_dtype), None


def weighted_act(act, h1, h3, g_N):
    """act(h1, h3), each row scaled by its gate g_N ([n]), differentiable in h1, h3 and g_N;
    plain act(h1, h3) when g_N is None."""
    if g_N is None:
        return act(h1, h3)
    return _WeightedAct.apply(h1, h3, g_N, act)
