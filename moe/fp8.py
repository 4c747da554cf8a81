"""Fine-grained FP8 quantization for the expert GEMMs (DeepSeek-V3's recipe), and its
emulation: what an FP8 grouped GEMM computes, written with bf16 matmuls so the CPU runs it and
the GPU kernels can be tested against it.

Shapes: T rows (tokens), K the reduced dim, N the output dim, E experts, tiles of 128.
  activations  one fp32 scale per 1 x 128 tile of a row (moe/wire.py quantize_tiles, the same
               tiles as the fp8 dispatch): scale = amax(tile) / 448, 1 for a tile of zeros
  weights      one fp32 scale per 128 x 128 block of each expert's [K, N] matrix
  values       x / scale rounded to float8 e4m3 (|x| / scale <= 448: never saturates)
A GEMM on quantized operands equals the GEMM of their dequantized values accumulated in fp32
(how Hopper's FP8 tensor cores with DeepSeek's promotion accumulate): `fp8_matmul` computes
exactly that -- dequantize, then an fp32 matmul -- and passes gradients straight through the
rounding (the backward GEMMs run on the dequantized operands). Not yet a training precision:
the building block of parallel.precision=fp8 (issue 47).
Weights whose K or N is not a multiple of 128 are refused: their blocks would straddle rows
no kernel tiles that way.
"""
import torch

from .wire import E4M3, E4M3_MAX, TILE, dequantize_tiles, quantize_tiles

__all__ = ["TILE", "quantize_blocks", "dequantize_blocks", "qdq_rows", "qdq_blocks", "fp8_matmul",
           "check_block_dims"]


def check_block_dims(K: int, N: int, where: str = "expert weight") -> None:
    if K % TILE or N % TILE:
        raise ValueError(f"FP8 with 128 x 128 weight blocks needs every dim of the {where} to be a "
                         f"multiple of {TILE} (got {K} x {N}); change moe.d_ff / model.d_model or "
                         f"train in bf16")


def quantize_blocks(w_KN: torch.Tensor):
    """[..., K, N] -> (q [..., K, N] float8 e4m3, scale [..., K/128, N/128] fp32): one scale
    per 128 x 128 block (amax / 448; 1 for a block of zeros)."""
    *lead, K, N = w_KN.shape
    check_block_dims(K, N)
    g, h = K // TILE, N // TILE
    blocks = w_KN.float().reshape(*lead, g, TILE, h, TILE)
    amax = blocks.abs().amax(dim=(-3, -1))                       # [..., g, h]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.reshape(*lead, K, N), scale


def dequantize_blocks(q_KN: torch.Tensor, scale, dtype=torch.float32) -> torch.Tensor:
    *lead, K, N = q_KN.shape
    blocks = q_KN.float().reshape(*lead, K // TILE, TILE, N // TILE, TILE)
    return (blocks * scale[..., :, None, :, None]).reshape(*lead, K, N).to(dtype)


def qdq_rows(x_TK: torch.Tensor) -> torch.Tensor:
    """x_TK rounded as its 1 x 128 tiles quantize (fp32 values)."""
    q, s = quantize_tiles(x_TK.reshape(-1, x_TK.shape[-1]))
    return dequantize_tiles(q, s, torch.float32).view(x_TK.shape)


def qdq_blocks(w_KN: torch.Tensor) -> torch.Tensor:
    """w_KN rounded as its 128 x 128 blocks quantize (fp32 values)."""
    return dequantize_blocks(*quantize_blocks(w_KN))


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK, w_KN):
        xq, wq = qdq_rows(x_TK), qdq_blocks(w_KN)
        ctx.save_for_backward(xq, wq)
        ctx.dtypes = (x_TK.dtype, w_KN.dtype)
        # within a 128-long stretch of K both operands share one scale each, so the fp32 GEMM
        # of the dequantized values is the kernel's sx * sw * sum(qx * qw), up to fp32 order
        return torch.matmul(xq, wq).to(x_TK.dtype)

    @staticmethod
    def backward(ctx, dy_TN):
        xq, wq = ctx.saved_tensors
        dy = dy_TN.float()
        dx = torch.matmul(dy, wq.mT).to(ctx.dtypes[0])
        dw = torch.matmul(xq.reshape(-1, xq.shape[-1]).mT, dy.reshape(-1, dy.shape[-1])).to(ctx.dtypes[1])
        return dx, dw


def fp8_matmul(x_TK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    """x_TK @ w_KN with both operands in fine-grained FP8 (module docstring), accumulated in
    fp32, returned in x's dtype; gradients straight through the rounding."""
    return _FP8Matmul.apply(x_TK, w_KN)
