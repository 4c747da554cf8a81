"""Expert FFNs as `torch._grouped_mm` calls: one grouped GEMM per projection and direction.

Shapes: N dispatched rows (sorted by expert), D model dim, F ffn dim, E local experts.
offs_E: int32 [E], the end row of each expert's slice (cumulative counts), on x's device.

Forward runs 2 (3 gated) grouped GEMMs; backward 2 for the input gradient (dh @ w^T, in the
2D x 3D form) and 2 (3) for the weight gradients (the 2D x 2D form x^T @ dh, which yields
[E, D, F] directly, zeros for an expert with no rows). There is no per-expert Python loop
and no host sync: the offsets come from the counts on the device (a tensor from the
dispatcher), so the caller need not know the counts on the host.

What `torch._grouped_mm` needs (torch 2.13, checked on CPU): fp32/bf16/fp16 operands (not
fp64), int32 offsets, and every stride a multiple of 16 bytes, i.e. D and F multiples of 4
(fp32) or 8 (bf16/fp16). `unsupported_reason` says which of these fails.
On CUDA (torch's support matrix, not yet measured here): the CUTLASS fast path, with no host
sync, takes bf16 on compute capability >= 9.0; fp32/fp16, and bf16 on 8.x, take torch's
fallback (a loop over groups that copies the offsets to the host); below 8.0 there is no
path. So "auto" on CUDA picks grouped_mm for bf16 on >= 9.0 and the loop otherwise, and an
explicit grouped_mm below 8.0 fails with one line.
"""
import torch
from torch._subclasses.fake_tensor import FakeTensor

from .row_gates import add_gated_bias, gate_bias_grad, gate_column, weighted, weighted_backward

EXPERT_IMPLS = ("auto", "loop", "grouped_mm")
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# experts_impl="auto": the measured-faster path per (device type, dtype); anything not listed
# uses "loop". Measured 2026-11-23 on the project's shared 2-core CPU (AMD EPYC, AVX2 only on
# that day; bench/moe_layer.py fwd+bwd, D=512 F=2048 gelu fp32, medians), ratio to the
# balanced bmm floor:
#   quiet (load 1.2-1.9), 2 threads, T=8192 E=16: k=2 loop 0.98x / 0.98x, grouped_mm 1.03x /
#        1.06x (two runs); k=1 loop 1.01x, grouped_mm 1.07x
#   quiet, 2 threads, T=2048 k=2, E = 8 16 32 64 128 256 (rows per expert 512 .. 16):
#        loop       1.09 1.13 1.11 1.13 1.29 1.45
#        grouped_mm 1.11 1.21 1.31 1.23 1.20 1.15
#   loaded (load 3-8): same order at E=16 (loop 1.35-1.47x, grouped_mm 1.52-1.63x)
#   bf16: that CPU has no bf16 GEMM kernel (0.4 GFLOP/s); at a toy size the two paths tie
# So on CPU the loop wins at >= 64 rows per expert and grouped_mm at <= 32 (E >= 128 here):
# "auto" keeps "loop" on CPU (per device and dtype it cannot see the rows per expert; a
# size-aware rule is a follow-up); pass experts_impl="grouped_mm" for many small experts.
# CUDA is not measured (no GPU here): the fast-path rule below (_cuda_fast_path) is torch's
# documented support, tests/gpu/test_moe_layer_cuda.py checks it runs and matches CPU.
AUTO_IMPL = {}


def unsupported_reason(device: torch.device, dtype: torch.dtype, d_model: int, d_ff: int):
    """Why torch._grouped_mm cannot run experts of this dtype and size, or None if it can."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype not in GROUPED_MM_DTYPES:
        return f"dtype {dtype} (grouped_mm takes float32, bfloat16 or float16)"
    size = torch.empty(0, dtype=dtype).element_size()
    bad = [f"{n}={v} ({v * size} bytes)" for n, v in (("d_model", d_model), ("d_ff", d_ff))
           if (v * size) % 16]
    if bad:
        return (f"{', '.join(bad)} in {dtype}: grouped_mm needs rows of a multiple of 16 "
                f"bytes")
    if device.type == "cuda" and _capability(device) < (8, 0):
        major, minor = _capability(device)
        return f"CUDA compute capability {major}.{minor} (grouped_mm needs >= 8.0)"
    return None


def _capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


def _cuda_fast_path(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on compute capability >= 9.0: the CUTLASS grouped GEMM (no host sync)."""
    return device.type == "cuda" and dtype == torch.bfloat16 and _capability(device) >= (9, 0)


def resolve_impl(impl: str, device: torch.device, dtype: torch.dtype, d_model: int, d_ff: int) -> str:
    """"loop" or "grouped_mm" for this call; an explicit "grouped_mm" that cannot run raises."""
    if impl == "loop":
        return "loop"
    reason = unsupported_reason(device, dtype, d_model, d_ff)
    if impl == "grouped_mm":
        if reason:
            raise ValueError(f"experts_impl='grouped_mm' cannot run here: {reason}; use "
                             f"experts_impl='auto' (falls back to 'loop') or 'loop'")
        return "grouped_mm"
    if reason:
        return "loop"
    if device.type == "cuda":  # the loop reads the counts on the host: never on a GPU
        return "grouped_mm"
    return AUTO_IMPL.get((device.type, dtype), "loop")


def offsets_from_counts(counts, device) -> torch.Tensor:
    """int32 [E] end rows from counts (a long tensor on the device, or Python ints)."""
    if isinstance(counts, torch.Tensor):
        return torch.cumsum(counts.to(device), 0, dtype=torch.int32)
    ends, total = [], 0
    for c in counts:
        total += int(c)
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)  # host -> device, no sync back


@torch.library.custom_op("moekit::grouped_mm", mutates_args=())
def _opaque_gmm(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm as an op torch.compile (and a fake-tensor trace) does not look into:
    its own fake kernel takes bf16 only, while the eager kernel takes fp32 and fp16 too."""
    return torch._grouped_mm(a, b, offs=offs_E)


@_opaque_gmm.register_fake
def _(a, b, offs_E):
    if b.dim() == 3:  # 2D x 3D: [N, K] rows through their expert's [K, M]
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs_E.shape[0], a.shape[0], b.shape[-1])  # 2D x 2D: per-expert [K, M]


def _gmm(a, b, offs_E):
    if a.dtype != torch.bfloat16 and (torch.compiler.is_compiling() or isinstance(a, FakeTensor)):
        return _opaque_gmm(a, b, offs_E)
    return torch._grouped_mm(a, b, offs=offs_E)


def _add_bias(h_NX, b_EX, expert_N):
    return h_NX if b_EX is None else h_NX + b_EX[expert_N]


def expert_of_rows(offs_E: torch.Tensor, n: int) -> torch.Tensor:
    """The expert of each of n rows sorted by expert (int32 end offsets): how many ends lie
    at or before the row; rows past the last end (padding) get the last expert."""
    rows = torch.arange(n, device=offs_E.device, dtype=torch.int32)
    return torch.searchsorted(offs_E, rows, right=True).clamp_(max=offs_E.shape[0] - 1)


class _GroupedMMFFN(torch.autograd.Function):
    """All experts' FFNs as grouped GEMMs; saves h1 (h3) and a (not a under act.recompute),
    like the loop path."""

    @staticmethod
    def forward(ctx, x_ND, offs_E, act, w1, w2, w3, b1, b2, b3, padded=False, gate_N=None):
        N, gated = x_ND.shape[0], w3 is not None
        has_bias = any(b is not None for b in (b1, b2, b3))
        expert_N = expert_of_rows(offs_E, N) if has_bias else None  # only for biases
        h1 = _add_bias(_gmm(x_ND, w1, offs_E), b1, expert_N)
        h3 = _add_bias(_gmm(x_ND, w3, offs_E), b3, expert_N) if gated else None
        if gate_N is None:
            a = act(h1, h3)
            y_ND = _add_bias(_gmm(a, w2, offs_E), b2, expert_N)
        else:  # moe.gates_in_experts: (g a) W2 + g b2, a computed again in backward
            a = None
            y_ND = _gmm(weighted(act, h1, h3, gate_N), w2, offs_E)
            y_ND = y_ND if b2 is None else add_gated_bias(y_ND, b2[expert_N], gate_N)
        # rows past the last offset (dropped assignments) are left unwritten by the kernel
        live_N1 = (torch.arange(N, device=x_ND.device) < offs_E[-1]).unsqueeze(1) if padded else None
        y_ND = y_ND if live_N1 is None else torch.where(live_N1, y_ND, 0)
        ctx.live_N1 = live_N1
        ctx.act = act
        ctx.has_bias = (b1 is not None, b2 is not None, b3 is not None)
        ctx.save_for_backward(x_ND, offs_E, expert_N, w1, w2, w3, b2, gate_N, h1, h3,
                              None if act.recompute else a)
        return y_ND

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy_ND):
        x_ND, offs_E, expert_N, w1, w2, w3, b2, gate_N, h1, h3, a = ctx.saved_tensors
        dy_ND = dy_ND.contiguous()
        gated = w3 is not None
        da = _gmm(dy_ND, w2.transpose(-2, -1), offs_E)
        g = dg = None
        if gate_N is not None:  # gates in the experts: one op gives dh, dg and g a
            g = gate_column(gate_N, h1.dtype)
            dh1, dh3, dg, a = weighted_backward(ctx.act, da, h1, h3, gate_N)
            if b2 is not None:
                dg = dg + gate_bias_grad(dy_ND, b2[expert_N])
            if ctx.live_N1 is not None:   # rows past the last offset: unwritten, not a gradient
                dg = torch.where(ctx.live_N1.squeeze(1), dg, 0)
        else:
            if a is None:  # moe_act: computed again rather than kept
                a = ctx.act(h1, h3)
            dh1, dh3 = ctx.act.backward(da, h1, h3)
        if ctx.live_N1 is not None and any(ctx.has_bias):  # unwritten rows must not reach db
            dh1, dh3 = (None if d is None else torch.where(ctx.live_N1, d, 0) for d in (dh1, dh3))
        dx = dw1 = dw2 = dw3 = db1 = db2 = db3 = None
        if ctx.needs_input_grad[0]:
            dx = _gmm(dh1, w1.transpose(-2, -1), offs_E)
            if gated:
                dx += _gmm(dh3, w3.transpose(-2, -1), offs_E)
            if ctx.live_N1 is not None:
                dx = torch.where(ctx.live_N1, dx, 0)
        if any(ctx.needs_input_grad[3:]):
            dw1 = _gmm(x_ND.t(), dh1, offs_E)
            dw2 = _gmm(a.t(), dy_ND, offs_E)
            dw3 = _gmm(x_ND.t(), dh3, offs_E) if gated else None
            E = w1.shape[0]
            db1, db2, db3 = (
                x_ND.new_zeros(E, src.shape[-1]).index_add_(0, expert_N, src) if has else None
                for has, src in zip(ctx.has_bias, (dh1, dy_ND if g is None else dy_ND * g, dh3)))
        return dx, None, None, dw1, dw2, dw3, db1, db2, db3, None, \
            None if dg is None else dg.to(gate_N.dtype)


def grouped_mm_ffn(x_ND, counts, act, w1, w2, w3=None, b1=None, b2=None, b3=None,
                   padded=False, gate_N=None):
    """Expert e's FFN on rows [sum(counts[:e]), sum(counts[:e+1])) of x_ND via grouped GEMMs.

    act: a moe.activations.Activation (its forward and backward). counts: long [E] tensor
    (no host sync) or Python ints. padded: x_ND may hold rows past sum(counts) (dropped
    assignments, static shapes): their outputs and gradients are zero. gate_N: None, or each
    row's routing gate (fp32 [N]) applied inside (moe/row_gates.py).
    """
    if len(counts) != w1.shape[0]:
        raise ValueError(f"counts has {len(counts)} entries for {w1.shape[0]} local experts")
    offs_E = offsets_from_counts(counts, x_ND.device)
    return _GroupedMMFFN.apply(x_ND.contiguous(), offs_E, act, w1, w2, w3, b1, b2, b3, padded, gate_N)
