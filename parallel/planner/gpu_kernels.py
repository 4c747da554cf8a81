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

Attention whose value heads are narrower than its query/key heads (MLA: 192 against 128)
is the other: on CUDA `F.scaled_dot_product_attention` runs it in the memory-efficient
kernel (one op each way, the scores never written), where the CPU has no fused kernel for
unequal head dims and runs the math path, writing and reading the [S, S] scores and
probabilities several times.

`gpu_kernels()` is a TorchFunctionMode for the trace: each `F.rms_norm` call runs as
`fused_rms_norm` below, and such an attention as `fused_attention`, autograd functions over
opaque ops that read and write exactly the fused kernels' tensors, so the census counts the
GPU's bytes. Their maths is the function's own (RMSNorm: fp32 statistics, the result in x's
dtype; attention: softmax(q k^T scale) v, causal or not, through the math path), so a trace
that computes gets the same values (tests/unit/test_planner_gpu_kernels.py).
"""
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from moe.dtypes import accumulation_dtype

__all__ = ["gpu_kernels", "fused_rms_norm", "fused_attention"]


def _rstd(x, eps: float):
    xf = x.to(accumulation_dtype(x.dtype))
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
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=accumulation_dtype(x.dtype))


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


def _scores(q, k, causal: bool, scale: float):
    """q k^T scale in fp32 (fp64 for fp64), the future masked to -inf when causal."""
    acc = accumulation_dtype(q.dtype)
    s = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    if causal:
        S, L = s.shape[-2:]
        s = s.masked_fill(torch.ones(S, L, dtype=torch.bool, device=s.device).triu(L - S + 1),
                          float("-inf"))
    return s


def _attend(q, k, v, causal: bool, scale: float):
    """softmax(q k^T scale) v and its log-sum-exp per query [B, H, S] (fp32, fp64 for fp64)."""
    acc = accumulation_dtype(q.dtype)
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    return ((s - lse.unsqueeze(-1)).exp() @ v.to(acc)).to(q.dtype), lse


@torch.library.custom_op("moekit_planner::fused_attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _attend(q, k, v, causal, scale)


@torch.library.custom_op("moekit_planner::fused_attention_backward", mutates_args=())
def _attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        o: torch.Tensor, lse: torch.Tensor, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qf, kf, vf, dof = (t.to(lse.dtype) for t in (q, k, v, do))
    p = (_scores(qf, kf, causal, scale) - lse.unsqueeze(-1)).exp()   # the probabilities, again
    ds = p * (dof @ vf.transpose(-2, -1) - (dof * o.to(lse.dtype)).sum(-1, keepdim=True))
    return ((ds @ kf * scale).to(q.dtype), (ds.transpose(-2, -1) @ qf * scale).to(k.dtype),
            (p.transpose(-2, -1) @ dof).to(v.dtype))


@_attention.register_fake
def _(q, k, v, causal, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=accumulation_dtype(q.dtype))


@_attention_backward.register_fake
def _(do, q, k, v, o, lse, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = _attention(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        dq, dk, dv = _attention_backward(do.contiguous(), *ctx.saved_tensors, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """F.scaled_dot_product_attention as CUDA's memory-efficient kernel runs value heads
    narrower than the query's (one op each way: q, k, v in, the output and the log-sum-exp
    out; the scores never stored); anything else: F.scaled_dot_product_attention itself
    (a single fused op on the CPU as well)."""
    if attn_mask is not None or dropout_p or enable_gqa or q.shape[-1] == v.shape[-1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _FusedAttention.apply(q, k, v, bool(is_causal), float(scale))


class gpu_kernels(TorchFunctionMode):
    """Within it, F.rms_norm and narrow-value attention run as the GPU's fused kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # the mode is off while this runs: the fallbacks' own calls do not come back here
        if func is F.rms_norm:
            return fused_rms_norm(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return fused_attention(*args, **kwargs)
        return func(*args, **kwargs)
