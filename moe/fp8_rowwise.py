"""Rowwise FP8 grouped GEMMs for the expert banks (parallel.precision=fp8 with
parallel.fp8_recipe=rowwise), on torch's grouped scaled matmul, and when they pay.

Each projection y = x w of a bank (w [E, K, N], each expert's rows of x contiguous, int32 end
offsets) runs three GEMMs:
  forward  x [T, K] quantized per row (one fp32 scale per row, over K), w per expert and output
           column (one scale per (e, n), over K); torch._scaled_grouped_mm accumulates in fp32
           and writes bf16
  dgrad    dx = dy w^T: dy per row (over N), w per expert and input row (one scale per (e, k),
           over N), the same kernel
  wgrad    dw = x^T dy in bf16 (torch._grouped_mm): a per-expert reduction over that expert's
           rows, where a row's outlier would set the scale of a whole column; torchao's
           "rowwise_with_gw_hp" recipe keeps this GEMM in high precision for the same reason
Scales are dequantization multipliers, amax / 448 (1 for an all-zero row), as moe/wire.py's.
The kernel's contract (torch/_meta_registrations.py, `_meta_grouped_mm_common`): mat_a e4m3
row-major [T, K]; mat_b e4m3 column-major [E, K, N]; scale_a fp32 [T]; scale_b fp32 [E, N];
offs int32 [E]. Where the kernel does not exist (CPU, GPUs before SM90) the emulation
(`emulated_scaled_grouped_mm`: dequantize, fp32 GEMM per expert) computes the same values:
it is what CPU runs train with and the reference the GPU tier holds the kernel to.

When FP8 pays (`rowwise_pays`): an FP8 GEMM saves time only where its shape runs faster than
bf16 by more than the quantization costs. Measured on one H200 (torch 2.11, 2026-11-28,
grouped GEMMs of 16-64 experts): bf16 grouped GEMMs at 690-700 TFLOP/s; the FP8 kernel 1.21-
1.24x faster with a contraction of 2048, 1.00x with 768; quantizing a bf16 [T, K] activation
moves 3 bytes an element at about 0.27 TB/s eager and 1.0 TB/s compiled (torch ops; the
weights, 5 bytes an element from fp32 masters, twice a micro-batch). Per row of x, for
w [K, N] with r rows per expert:
  saved = 2 K N / R_bf16 * ((1 - 1 / s(K)) + (1 - 1 / s(N)))      forward and dgrad
  cost  = 3 (K + N) / B + 10 K N / (r B)                            x, dy, and w twice
FP8 pays where saved > cost; elsewhere the GEMM stays bf16. With K = N = d (the weights'
term aside), eager, FP8 pays from d of about 20,000, compiled from about 5,800: fine-grained
experts (Qwen3-30B's 2048 x 768) never do, Mixtral-8x22B's 6144 x 16384 does compiled with
32k rows an expert -- as published: Qwen3-30B-A3B's best bf16 rows beat its FP8 ones on
H100, Megatron-Core reports +20% on Mixtral-8x22B.
"""
import torch

from .grouped_mm import _add_bias, expert_of_rows, offsets_from_counts
from .row_gates import add_gated_bias, weighted_act
from .wire import E4M3, E4M3_MAX

__all__ = ["quantize_rows", "emulated_scaled_grouped_mm", "scaled_grouped_kernel", "rowwise_gemm",
           "rowwise_fp8_ffn", "rowwise_pays", "rowwise_choice", "fp8_speedup", "BF16_GROUPED_TFLOPS", "QUANT_TBS"]

BF16_GROUPED_TFLOPS = 700.0                   # H200, expert-shaped grouped bf16 GEMMs
FP8_SPEEDUP = ((768, 1.00), (2048, 1.22))     # (contraction, bf16 time / FP8 time), H200
QUANT_TBS = {"eager": 0.27, "compiled": 1.0}  # rowwise quantization, TB/s moved


def quantize_rows(x: torch.Tensor, dim: int = -1):
    """x in e4m3 with one fp32 scale per slice along `dim` (amax / 448; 1 where all zero):
    (q like x, scale with `dim` removed) and q * scale ~ x."""
    amax = x.detach().abs().amax(dim, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.squeeze(dim)


@torch.library.custom_op("moekit::emulated_scaled_grouped_mm", mutates_args=())
def _emulated_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    a32 = a.float() * scale_a[:, None]
    b32 = b.float() * scale_b[:, None, :]
    out = a32.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a32[start:end] @ b32[e]
        start = end
    return out.to(out_dtype)


@_emulated_op.register_fake
def _(a, b, scale_a, scale_b, offs, out_dtype):
    return a.new_empty(a.shape[0], b.shape[-1], dtype=out_dtype)


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=torch.bfloat16):
    """What torch._scaled_grouped_mm computes for 2D a [T, K] x 3D b [E, K, N] with rowwise
    scales: each expert's rows of a, dequantized, times its dequantized b in fp32, out in
    out_dtype; rows past the last offset zero. It reads the offsets on the host (CPU only),
    inside an op torch.compile does not trace into, so a compiled block holds it whole."""
    return _emulated_op(a, b, scale_a, scale_b, offs, out_dtype)


def scaled_grouped_kernel(device: torch.device, kernels):
    """torch._scaled_grouped_mm where it runs for real on `device` (kernels: moe/fp8.py
    FP8Kernels of that device), else the emulation."""
    return torch._scaled_grouped_mm if kernels.rowwise else emulated_scaled_grouped_mm


def _weight_fwd(w_EKN):
    """w as mat_b of the forward GEMM: e4m3 column-major [E, K, N], scales [E, N] (over K)."""
    q_ENK, s_EN = quantize_rows(w_EKN.mT, -1)
    return q_ENK.contiguous().mT, s_EN.contiguous()


def _weight_dgrad(w_EKN):
    """w^T as mat_b of dgrad: e4m3 column-major [E, N, K], scales [E, K] (over N)."""
    q_EKN, s_EK = quantize_rows(w_EKN, -1)
    return q_EKN.contiguous().mT, s_EK.contiguous()


class _RowwiseGemm(torch.autograd.Function):
    """y = x w per expert (module docstring): FP8 forward and dgrad, bf16 wgrad."""

    @staticmethod
    def forward(ctx, x_TK, w_EKN, offs_E, kernel):
        qx, sx = quantize_rows(x_TK, -1)
        qw, sw = _weight_fwd(w_EKN)
        ctx.kernel = kernel
        ctx.save_for_backward(x_TK, w_EKN, offs_E)
        return kernel(qx.contiguous(), qw, sx.contiguous(), sw, offs=offs_E, out_dtype=x_TK.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy_TN):
        x_TK, w_EKN, offs_E = ctx.saved_tensors
        dy_TN = dy_TN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qdy, sdy = quantize_rows(dy_TN, -1)
            qw, sw = _weight_dgrad(w_EKN)
            dx = ctx.kernel(qdy.contiguous(), qw, sdy.contiguous(), sw, offs=offs_E,
                            out_dtype=x_TK.dtype)
        if ctx.needs_input_grad[1]:
            dw = torch._grouped_mm(x_TK.t(), dy_TN.to(x_TK.dtype), offs=offs_E).to(w_EKN.dtype)
        return dx, dw, None, None


def rowwise_gemm(x_TK, w_EKN, offs_E, kernel, fp8: bool = True):
    """Each expert's rows of x_TK (bf16) times its w (fp32 master or bf16): in rowwise FP8
    through `kernel` (scaled_grouped_kernel's) where fp8, else a bf16 grouped GEMM."""
    if fp8:
        return _RowwiseGemm.apply(x_TK, w_EKN, offs_E, kernel)
    return torch._grouped_mm(x_TK, w_EKN.to(x_TK.dtype), offs=offs_E)


def rowwise_fp8_ffn(kernel, x_ND, counts, act, w1, w2, w3=None, b1=None, b2=None, b3=None,
                    fp8=(True, True, True), gate_N=None):
    """Expert e's FFN on its rows of x_ND (bf16, sorted by expert, counts per expert: a long
    tensor on the device or ints) with w1, w2, w3 in rowwise FP8 where fp8 says so (rowwise_pays
    per projection), bf16 grouped GEMMs elsewhere; biases and the activation in bf16. gate_N:
    None, or each row's routing gate applied inside (moe/row_gates.py)."""
    offs_E = offsets_from_counts(counts, x_ND.device)
    has_bias = any(b is not None for b in (b1, b2, b3))
    expert_N = expert_of_rows(offs_E, x_ND.shape[0]) if has_bias else None

    def proj(a, w, b, on):
        y = rowwise_gemm(a, w, offs_E, kernel, on)
        return _add_bias(y, None if b is None else b.to(y.dtype), expert_N)

    x_ND = x_ND.contiguous()
    h1 = proj(x_ND, w1, b1, fp8[0])
    h3 = proj(x_ND, w3, b3, fp8[2]) if w3 is not None else None
    if gate_N is None:
        return proj(act(h1, h3).contiguous(), w2, b2, fp8[1])
    y = proj(weighted_act(act, h1, h3, gate_N).contiguous(), w2, None, fp8[1])
    return y if b2 is None else add_gated_bias(y, b2[expert_N], gate_N)


def fp8_speedup(contraction: int) -> float:
    """The FP8 kernel's speed over bf16 for a GEMM of this contraction (FP8_SPEEDUP, linear
    between the measured points)."""
    (k0, s0), (k1, s1) = FP8_SPEEDUP
    if contraction <= k0:
        return s0
    if contraction >= k1:
        return s1
    return s0 + (s1 - s0) * (contraction - k0) / (k1 - k0)


def rowwise_pays(K: int, N: int, rows_per_expert: float, compiled: bool,
                 rows_of: str = "an expert") -> tuple:
    """(pays, why) for an expert projection w [K, N] in rowwise FP8 rather than bf16, by the
    module docstring's model: the seconds saved and spent per row of x, in words."""
    saved = 2 * K * N / (BF16_GROUPED_TFLOPS * 1e12) * ((1 - 1 / fp8_speedup(K)) + (1 - 1 / fp8_speedup(N)))
    bw = QUANT_TBS["compiled" if compiled else "eager"] * 1e12
    cost = 3 * (K + N) / bw + 10 * K * N / (max(rows_per_expert, 1.0) * bw)
    why = (f"[{K} x {N}]: FP8 saves {saved * 1e9:.2f} ns a row, quantizing costs {cost * 1e9:.2f} "
           f"({'compiled' if compiled else 'eager'}, {rows_per_expert:.0f} rows {rows_of})")
    return saved > cost, why


def rowwise_choice(D: int, F: int, rows_per_expert: float, real_kernel: bool, compiled: bool) -> tuple:
    """((w1, w2, w3) in FP8 or not, why for [D x F] and [F x D]) for a bank's projections:
    all FP8 where the kernel is emulated (CPU: the tests' reference; no reasons), else by
    rowwise_pays (w1 and w3 share a shape)."""
    if not real_kernel:
        return (True, True, True), ()
    up, why_up = rowwise_pays(D, F, rows_per_expert, compiled)
    down, why_down = rowwise_pays(F, D, rows_per_expert, compiled)
    return (up, down, up), (why_up, why_down)
