"""The GPU's kernels where a CPU trace would count a different set of ops (traced_bytes.py).

The planner counts a step's memory-bound bytes by running the single-device model on fake
CPU tensors. Most ops run as one kernel on both devices, with the same tensors read and
written. RMSNorm does not: `F.rms_norm` (models/layers.py rms_norm, with the weight in the
input's dtype) takes torch's fused kernels on CUDA (`aten::_fused_rms_norm` and its
backward, torch >= 2.8), one kernel each way, while on the CPU it decomposes into about
fifteen element-wise ops and reductions whose intermediates (the square, the mean, the
normalised input, fp32 copies) are read and written again: a CPU trace counts about 75
[T, D] bf16 tensors of traffic for one norm's forward and backward, where the GPU moves 5
(forward: x in, y out; backward: dy and x in, dx out; plus the fp32 rstd [T] and the
weight and its gradient [D]).

`gpu_kernels()` is a TorchFunctionMode for the trace: each `F.rms_norm` call runs as
`fused_rms_norm` below, an autograd function over two opaque ops that read and write
exactly the fused kernels' tensors, so the census counts the GPU's bytes. Their maths is
RMSNorm's (fp32 statistics, the result in x's dtype), so a trace that computes gets the
same values as `F.rms_norm` (tests/unit/test_planner_gpu_kernels.py).
"""
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["gpu_kernels", "fused_rms_norm"]


def _acc(dtype):
    return torch.promote_types(dtype, torch.float32)


def _rstd(x, eps: float):
    xf = x.to(_acc(x.dtype))
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


@torch.library.custom_op("moekit_planner::fused_rms_norm", mutates_args=())
def _forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = _rstd(x, eps)
    return (x.to(rstd.dtype) * rstd * w.to(rstd.dtype)).to(x.dtype), rstd


@torch.library.custom_op("moekit_planner::fused_rms_norm_backward", mutates_args=())
def _backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
              w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xhat = x.to(rstd.dtype) * rstd
    dxhat = dy.to(rstd.dtype) * w.to(rstd.dtype)
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dw = (dy.to(rstd.dtype) * xhat).reshape(-1, w.numel()).sum(0)
    return dx.to(x.dtype), dw.reshape(w.shape).to(w.dtype)


@_forward.register_fake
def _(x, w, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=_acc(x.dtype))


@_backward.register_fake
def _(dy, x, rstd, w):
    return torch.empty_like(x), torch.empty_like(w)


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        y, rstd = _forward(x, w, eps)
        ctx.save_for_backward(x, rstd, w)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd, w = ctx.saved_tensors
        dx, dw = _backward(dy.contiguous(), x, rstd, w)
        return dx, dw, None


def fused_rms_norm(x, normalized_shape, weight=None, eps=None):
    """F.rms_norm over the last dim as the fused CUDA kernels run it (one op each way);
    anything else (no weight, several normalised dims, mixed dtypes): F.rms_norm itself."""
    shape = tuple(normalized_shape) if not isinstance(normalized_shape, int) else (normalized_shape,)
    if weight is None or len(shape) != 1 or weight.dtype != x.dtype:
        return F.rms_norm(x, normalized_shape, weight, eps)
    return _FusedRMSNorm.apply(x, weight, torch.finfo(x.dtype).eps if eps is None else eps)


class gpu_kernels(TorchFunctionMode):
    """Within it, F.rms_norm runs as the GPU's fused kernels (fused_rms_norm)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.rms_norm:   # the mode is off while this runs: no loop
            return fused_rms_norm(*args, **kwargs)
        return func(*args, **kwargs)
