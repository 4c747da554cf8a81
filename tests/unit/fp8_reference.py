"""Fine-grained FP8 written out by hand from the recipe, not from moe/fp8.py or moe/wire.py:
the reference the FP8 tests compare the emulation and the grouped path against.

  tiles      (1, 128): each row's 128 consecutive columns (activations along K, dy along N)
             (128, 1): each column's 128 consecutive rows (x and dy along T, for dw)
             (128, 128): a weight block
             a tile cut short by the edge of the matrix is a tile of its own
  scale      fp32, amax(|tile|) / 448 (1 for a tile of zeros)
  value      the fp32 quotient x / scale rounded to e4m3 by `e4m3` (3 mantissa bits, exponent
             from -6 down to subnormals spaced 2^-9, round half to even), no saturation needed
  dequant    value * scale in float64 (exact: 4 significant bits times 24)
  GEMM       the float64 product of the dequantized operands
  backward   DeepSeek-V3's: dx = q(dy, 1x128) q(w, 128x128)^T, dw = q(x, 128x1)^T q(dy, 128x1)

Everything is a Python loop over tiles with plain torch ops, so a wrong tile shape, scale
constant or rounding in the code under test shows up as an O(2^-4) difference on some
element, while the code's legitimate difference from this reference is fp32 rounding only
(its dequantize and its fp32 accumulation).
"""
import torch

E4M3_LARGEST = 448.0     # 1.75 x 2^8, the largest finite float8 e4m3fn value
E4M3_MIN_EXP = -6        # the smallest normal exponent; below it the spacing stays 2^-9
E4M3_MANTISSA_BITS = 3
TILE = 128


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, as float64."""
    v = v.double()
    _, exp = torch.frexp(v)                         # v = m 2^exp, 1/2 <= |m| < 1
    lead = torch.clamp(exp - 1, min=E4M3_MIN_EXP)   # the exponent of the leading bit
    step = torch.ldexp(torch.ones_like(v), lead - E4M3_MANTISSA_BITS)
    return torch.round(v / step) * step             # torch.round: half to even


def qdq(a: torch.Tensor, tile: tuple) -> torch.Tensor:
    """a [R, C] as FP8 with one fp32 scale per `tile` ((1, 128), (128, 1) or (128, 128)),
    dequantized, in float64."""
    a = a.detach().float()
    R, C = a.shape
    tr, tc = tile
    # a tile of 1 along a dim: every row (column) has its own scales, handled at once
    step_r, step_c = (tr if tr > 1 else R), (tc if tc > 1 else C)
    dims = tuple(d for d, t in enumerate(tile) if t > 1)
    out = torch.empty(R, C, dtype=torch.float64)
    for i in range(0, R, step_r):
        for j in range(0, C, step_c):
            t = a[i:i + step_r, j:j + step_c]
            amax = t.abs().amax(dim=dims, keepdim=True)
            scale = torch.where(amax > 0, amax / torch.tensor(E4M3_LARGEST), torch.ones_like(amax))
            out[i:i + step_r, j:j + step_c] = e4m3(t / scale) * scale.double()
    return out


ROWS, COLS, BLOCKS = (1, TILE), (TILE, 1), (TILE, TILE)


class HandFP8Matmul(torch.autograd.Function):
    """x [T, K] @ w [K, N] in FP8 by the recipe above, out in `out_dtype` (x's by default);
    gradients by DeepSeek-V3's FP8 backward, in x's and w's dtypes."""

    @staticmethod
    def forward(ctx, x, w, out_dtype=None):
        ctx.save_for_backward(x, w)
        return (qdq(x, ROWS) @ qdq(w, BLOCKS)).to(out_dtype or x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = qdq(dy, ROWS) @ qdq(w, BLOCKS).T
        dw = qdq(x, COLS).T @ qdq(dy, COLS)
        return dx.to(x.dtype), dw.to(w.dtype), None


def hand_fp8_matmul(x, w, out_dtype=None):
    return HandFP8Matmul.apply(x, w, out_dtype)


def fp32_gemm_bound(a_abs: torch.Tensor, b_abs: torch.Tensor) -> torch.Tensor:
    """Per element: how far an fp32 GEMM of the (fp32-dequantized) operands may be from the
    float64 GEMM of the exactly dequantized ones: each operand one fp32 rounding (2u) and a
    sum of n products in any order gamma_n = n u / (1 - n u) (Higham, Thm 3.1), all of
    |a| |b|; u = 2^-24, n the reduced dim, 1% slack."""
    u = 2.0 ** -24
    n = a_abs.shape[-1]
    return 1.01 * (2 * u + n * u / (1 - n * u)) * (a_abs.double() @ b_abs.double())
