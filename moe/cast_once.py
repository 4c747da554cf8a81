"""One low-precision copy of a layer's input for all the projections reading it, under autocast.

Autocast casts an op's fp32 input for each op that reads it, and each projection keeps its own
cast for its weight's gradient: q, k and v kept three bf16 copies of the same normalised input
(MLA's two down-projections two; the plain-ops expert path's w1 and w3 two: a dense FFN under
tensor parallelism), where one serves them all (Megatron's fused QKV keeps one); torchao's
FP8 Linears under CUDA's autocast too (they cast their input to it and keep the cast:
models/layers._share_cast).
`readers(x, n)` casts once and hands the n readers n aliases of that one copy; each reader's
gradient comes back on its own alias and they are summed in x's dtype (fp32), as the n
separate casts' gradients were. Nothing changes without autocast or for a tensor already in
the autocast dtype. Under tensor parallelism x is the gathered input (a replicated DTensor,
tp D per token): the one copy matters most there.

`announce(src, out, rebuild)`: out is rebuild(src) and nothing else. Where src is watched
(parallel/output_recompute.py watches a norm's output so that backward can compute it again,
parallel.recompute_modules=layernorm) out is watched too, rebuilt from src's recomputed value;
the one copy above and tensor parallelism's gathers of a watched input announce themselves,
so the copy the projections keep is recomputed rather than held. A no-op where nothing
watches src.
"""
import functools

import torch

__all__ = ["announce", "readers"]
WATCH = "_moekit_rebuild_watch"   # the attribute a watched tensor carries (a callable)


def announce(src: torch.Tensor, out: torch.Tensor, rebuild) -> None:
    """Tell a watcher of src, if any, that out == rebuild(src) (see the module docstring).
    Inside a compiled graph nothing is announced: the graph's partitioner decides what it
    saves (parallel/compile.py compiles a recomputing block's regions around the notes)."""
    if torch.compiler.is_compiling():
        return
    watch = getattr(src, WATCH, None)
    if watch is not None:
        watch(out, rebuild)


def _cast(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(dtype)


class _CastOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dtype, n: int):
        ctx.dtype = x.dtype
        low = x.to(dtype)
        return tuple(low.view_as(low) for _ in range(n))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        total = None
        for g in grads:
            if g is not None:
                g = g.to(ctx.dtype)
                total = g if total is None else total + g
        return total, None, None


def readers(x: torch.Tensor, n: int) -> tuple:
    """n tensors to hand to n ops that read x: under autocast n aliases of one cast of x,
    else x n times."""
    dev = x.device.type
    if not x.is_floating_point() or not torch.is_autocast_enabled(dev):
        return (x,) * n
    dtype = torch.get_autocast_dtype(dev)
    if x.dtype == dtype or not torch.is_grad_enabled() or not x.requires_grad:
        return (x,) * n
    out = _CastOnce.apply(x, dtype, n)
    announce(x, out[0], functools.partial(_cast, dtype=dtype))   # the n aliases share its storage
    return out
