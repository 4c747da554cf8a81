"""The router's fused ops: the logits GEMM with an fp32 result, and the scores with the
router's two statistics (z-loss, entropy) in one pass over the logits.

Shapes: T tokens, D model dim, E experts.

router_logits(x_TD, w_ED) -> fp32 [T, E], for a bf16/fp16 input. The [T, D] input is not
    copied to fp32 on a GPU: one GEMM reads the low-precision operands and accumulates and
    writes fp32 (`torch.mm(..., out_dtype=torch.float32)`). Its backward rounds the logits'
    gradient ([T, E], small) to the input dtype and runs two low-precision GEMMs with fp32
    accumulation, as an autocast backward would. Elsewhere (the CPU) both directions widen to
    fp32 and compute exactly what the plain ops `x.float() @ w.float().t()` compute.
score_stats(logits, score_func) -> (scores, z_loss, entropy): softmax or sigmoid scores, the
    ST-MoE z-loss (mean of logsumexp^2, with gradient) and the mean per-token entropy of the
    scores as a distribution (no gradient). Seven ops and their backward chain as one op each
    way, compiled into few kernels on CUDA (moe/fusion.py); eager aten elsewhere, the same
    ops as unfused, so the values are those of moe/scoring.py and moe/losses.py.
"""
from typing import Optional

import torch

from .fusion import is_plain, run_fused
from .losses import router_z_loss
from .scoring import balance_probs, scores_from_logits

LOW_PRECISION = (torch.bfloat16, torch.float16)


def mean_entropy(probs: torch.Tensor) -> torch.Tensor:
    """fp32 scalar: the mean over tokens of the entropy (nats) of each token's distribution
    over the last dim (no gradient)."""
    with torch.no_grad():
        return torch.special.entr(probs.float()).sum(-1).mean()


def _stats_forward(logits: torch.Tensor, score_func: str):
    scores = scores_from_logits(logits, score_func)
    return scores, router_z_loss(logits), mean_entropy(balance_probs(scores, score_func))


def _stats_backward(g_scores: Optional[torch.Tensor], g_z: Optional[torch.Tensor],
                    logits: torch.Tensor, scores: torch.Tensor, score_func: str):
    g = None
    if g_scores is not None:
        if score_func == "softmax":
            g = torch.ops.aten._softmax_backward_data(g_scores, scores, -1, logits.dtype)
        else:
            g = torch.ops.aten.sigmoid_backward(g_scores, scores)
    if g_z is not None:  # d mean(lse^2) = 2 lse / n * softmax(logits)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        g_z_TE = g_z / lse.numel() * (2 * lse) * (logits - lse).exp()
        g = g_z_TE if g is None else g + g_z_TE
    return torch.zeros_like(logits) if g is None else g


@torch.library.custom_op("moekit::score_stats", mutates_args=())
def score_stats(logits: torch.Tensor, score_func: str) -> tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    return run_fused(_stats_forward, logits, logits, score_func)


@torch.library.custom_op("moekit::score_stats_backward", mutates_args=())
def score_stats_backward(g_scores: Optional[torch.Tensor], g_z: Optional[torch.Tensor],
                         logits: torch.Tensor, scores: torch.Tensor,
                         score_func: str) -> torch.Tensor:
    return run_fused(_stats_backward, logits, g_scores, g_z, logits, scores, score_func)


@score_stats.register_fake
def _(logits, score_func):
    scalar = logits.new_empty(())
    return torch.empty_like(logits), scalar, logits.new_empty((), dtype=torch.float32)


@score_stats_backward.register_fake
def _(g_scores, g_z, logits, scores, score_func):
    return torch.empty_like(logits)


def _stats_setup(ctx, inputs, output):
    logits, ctx.score_func = inputs
    scores, _, entropy = output
    ctx.mark_non_differentiable(entropy)
    ctx.save_for_backward(logits, scores)


def _stats_autograd(ctx, g_scores, g_z, _g_entropy):
    logits, scores = ctx.saved_tensors
    g_scores = None if g_scores is None else g_scores.contiguous()
    return score_stats_backward(g_scores, g_z, logits, scores, ctx.score_func), None


score_stats.register_autograd(_stats_autograd, setup_context=_stats_setup)


@torch.library.custom_op("moekit::router_logits", mutates_args=())
def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    if x_TD.is_cuda and w_ED.dtype == x_TD.dtype:
        return torch.mm(x_TD, w_ED.t(), out_dtype=torch.float32)
    return x_TD.to(torch.float32) @ w_ED.to(torch.float32).t()


@torch.library.custom_op("moekit::router_logits_backward", mutates_args=())
def router_logits_backward(g_TE: torch.Tensor, x_TD: torch.Tensor,
                           w_ED: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x_TD.is_cuda and w_ED.dtype == x_TD.dtype:
        g_low = g_TE.to(x_TD.dtype)
        gw = torch.mm(g_low.t(), x_TD, out_dtype=torch.float32).to(w_ED.dtype)
        return g_low @ w_ED, gw
    w32_ED = w_ED.to(torch.float32)
    gx = (g_TE @ w32_ED).to(x_TD.dtype)
    return gx, (g_TE.t() @ x_TD.to(torch.float32)).to(w_ED.dtype)


@router_logits.register_fake
def _(x_TD, w_ED):
    return x_TD.new_empty((x_TD.shape[0], w_ED.shape[0]), dtype=torch.float32)


@router_logits_backward.register_fake
def _(g_TE, x_TD, w_ED):
    return torch.empty_like(x_TD), torch.empty_like(w_ED)


def _logits_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _logits_autograd(ctx, g_TE):
    x_TD, w_ED = ctx.saved_tensors
    return router_logits_backward(g_TE.contiguous(), x_TD, w_ED)


router_logits.register_autograd(_logits_autograd, setup_context=_logits_setup)


def plain(*tensors) -> bool:
    """Plain tensors (no DTensor or other subclass), and no autocast on their device: where
    the custom ops apply."""
    return all(is_plain(t) for t in tensors) and \
        not torch.is_autocast_enabled(tensors[0].device.type)
