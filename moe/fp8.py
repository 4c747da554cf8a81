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
exactly that -- dequantize, then an fp32 matmul (autocast off) -- and passes gradients
straight through the rounding. Backward is FP8 too, as in DeepSeek-V3: the input gradient
dx = dy w^T quantizes dy per 1 x 128 tile of its rows (along N, the reduced dim) against the
same weight blocks; the weight gradient dw = x^T dy quantizes x and dy per 128 x 1 tile
along T (the reduced dim there). parallel.precision=fp8 runs every expert bank (routed
experts, shared experts, dense FFNs) through it (ExpertBank.set_fp8).
Weights whose K or N is not a multiple of 128 are refused: their blocks would straddle rows
no kernel tiles that way.

On a GPU with real kernels for these tiles -- torchao's grouped blockwise FP8 GEMM
(torchao.prototype.moe_training.blockwise_fp8) on its DeepGEMM backend, which needs CUDA
SM90+ and the optional `deep_gemm` package; without it torchao itself only emulates --
`grouped_fp8_kernel` returns that GEMM and the banks run through `grouped_fp8_ffn`: the same
tiles (each expert's token group padded to 128 rows, so the 128 x 1 wgrad tiles start at the
group's first token as here), one launch per projection and direction, no per-expert loop.
Everywhere else the emulation above runs; tests/gpu/test_fp8_cuda.py holds the kernel to it.
Which kernels can run on a GPU is one predicate, `fp8_kernels` (compute capability, deep_gemm
installed): the runtime asks it for the live device, the planner for a preset's GPU.
"""
import importlib.util
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from .row_gates import add_gated_bias, weighted_act
from .wire import E4M3, E4M3_MAX, TILE, dequantize_tiles, quantize_tiles

__all__ = ["TILE", "quantize_blocks", "dequantize_blocks", "qdq_rows", "qdq_cols", "qdq_blocks",
           "fp8_matmul", "check_block_dims", "FP8Kernels", "fp8_kernels", "device_fp8_kernels",
           "grouped_fp8_kernel", "grouped_fp8_ffn", "bank_recipe", "emulated_gemms"]

# the compute capability (major, minor) from which each FP8 kernel exists
FP8_MATMUL_CAPABILITY = (8, 9)    # torch's FP8 tensor-core matmul (torchao's Float8Linear): Ada, Hopper+
FP8_GROUPED_CAPABILITY = (9, 0)   # DeepGEMM's grouped FP8 GEMM (through torchao): Hopper+
FP8_ROWWISE_CAPABILITY = (9, 0)   # torch._scaled_grouped_mm (moe/fp8_rowwise.py): Hopper+


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


def qdq_cols(x_TK: torch.Tensor) -> torch.Tensor:
    """x_TK [T, K] rounded as its 128 x 1 tiles (along T) quantize (fp32 values)."""
    return qdq_rows(x_TK.mT.contiguous()).mT


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK, w_KN):
        x2 = x_TK.reshape(-1, x_TK.shape[-1])
        wq = qdq_blocks(w_KN)
        # keep the operands as they are (the weight is the parameter itself: no copy) and
        # quantize again in backward, so no FP8 or dequantized copy lives between the passes
        ctx.save_for_backward(x2, w_KN)
        ctx.dtypes, ctx.shape = (x_TK.dtype, w_KN.dtype), x_TK.shape
        # within a 128-long stretch of K both operands share one scale each, so the fp32 GEMM
        # of the dequantized values is the kernel's sx * sw * sum(qx * qw), up to fp32 order
        with torch.autocast(x_TK.device.type, enabled=False):
            y = torch.matmul(qdq_rows(x2), wq)
        return y.view(*x_TK.shape[:-1], w_KN.shape[-1]).to(x_TK.dtype)

    @staticmethod
    def backward(ctx, dy_TN):
        x2, w_KN = ctx.saved_tensors
        dy = dy_TN.reshape(-1, dy_TN.shape[-1])
        with torch.autocast(dy.device.type, enabled=False):
            dx = torch.matmul(qdq_rows(dy), qdq_blocks(w_KN).mT)
            dw = torch.matmul(qdq_cols(x2).mT, qdq_cols(dy))
        return dx.view(ctx.shape).to(ctx.dtypes[0]), dw.to(ctx.dtypes[1])


def fp8_matmul(x_TK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    """x_TK @ w_KN with both operands in fine-grained FP8 (module docstring), accumulated in
    fp32, returned in x's dtype; gradients straight through the rounding."""
    return _FP8Matmul.apply(x_TK, w_KN)


@dataclass(frozen=True)
class FP8Kernels:
    matmul: bool    # the Linears' FP8 matmuls run for real (parallel/fp8.py), not torchao's emulation
    grouped: bool   # the banks' grouped blockwise FP8 GEMM runs for real (grouped_fp8_kernel)
    rowwise: bool = False  # the banks' grouped rowwise FP8 GEMM runs for real (moe/fp8_rowwise.py)


def fp8_kernels(capability, deep_gemm: bool) -> FP8Kernels:
    """Which FP8 kernels a CUDA GPU of `capability` ((major, minor); None: no CUDA GPU) runs,
    with the `deep_gemm` package installed or not; the rest runs the emulation. One predicate
    for the runtime (device_fp8_kernels) and the planner (a preset's GPU, parallel/planner/
    hardware.py), so the step the planner prices at the FP8 rate is the one that runs it."""
    if capability is None:
        return FP8Kernels(False, False, False)
    cap = tuple(capability)
    return FP8Kernels(cap >= FP8_MATMUL_CAPABILITY, deep_gemm and cap >= FP8_GROUPED_CAPABILITY,
                      cap >= FP8_ROWWISE_CAPABILITY and hasattr(torch, "_scaled_grouped_mm"))


def _deep_gemm_installed() -> bool:
    return importlib.util.find_spec("deep_gemm") is not None   # found, not imported


def device_fp8_kernels(device: torch.device) -> FP8Kernels:
    """fp8_kernels of a live device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return fp8_kernels(None, False)
    return fp8_kernels(torch.cuda.get_device_capability(device), _deep_gemm_installed())


def bank_recipe(fp8_recipe: str) -> str:
    """The expert banks' FP8 recipe under parallel.fp8_recipe: rowwise scales on torch's grouped
    scaled matmul for `rowwise`, DeepSeek-V3's 128x128 blocks otherwise."""
    return "rowwise" if fp8_recipe == "rowwise" else "blockwise"


def emulated_gemms(kernels: FP8Kernels, fp8_recipe: str = "tensorwise") -> list:
    """Which of precision=fp8's GEMMs would run the emulation (quantize, dequantize, an fp32
    matmul: 3.8-5.3x slower than bf16 on an H200) with these kernels and parallel.fp8_recipe;
    [] when none would."""
    out = []
    if bank_recipe(fp8_recipe) == "rowwise" and not kernels.rowwise:
        out.append("the expert banks' and FFNs' rowwise GEMMs (torch._scaled_grouped_mm needs "
                   f"compute capability {FP8_ROWWISE_CAPABILITY[0]}.{FP8_ROWWISE_CAPABILITY[1]}+)")
    if bank_recipe(fp8_recipe) == "blockwise" and not kernels.grouped:
        out.append("the expert banks' and FFNs' 128x128-block GEMMs (torchao's grouped kernel "
                   "needs the deep_gemm package and compute capability 9.0+)")
    if not kernels.matmul:
        out.append("the attention Linears' GEMMs (FP8 matmuls need compute capability "
                   f"{FP8_MATMUL_CAPABILITY[0]}.{FP8_MATMUL_CAPABILITY[1]}+)")
    return out


def grouped_fp8_kernel(device: torch.device):
    """torchao's grouped blockwise FP8 GEMM (A [T, K] row-major, B_t [E, K, N] column-major
    per expert, int32 end offsets) where it runs real FP8 kernels on `device`, else None."""
    if not device_fp8_kernels(device).grouped:
        return None
    try:   # torchao's kernels import triton (CUDA builds of torch only) and, for DeepGEMM, deep_gemm
        from torchao.prototype.blockwise_fp8_training.deepgemm_grouped_kernels import \
            can_use_deepgemm_grouped_training
        from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import \
            _to_fp8_blockwise_then_scaled_grouped_mm
    except ImportError:
        return None
    probe = torch.empty(0, TILE, device=device, dtype=torch.bfloat16)
    # torchao's word is final (a deep_gemm without the grouped entry points, say); fp8_kernels
    # is what can be known without a device, which the planner needs
    if not can_use_deepgemm_grouped_training(probe, torch.bfloat16, TILE):
        return None
    return _to_fp8_blockwise_then_scaled_grouped_mm


def grouped_fp8_ffn(kernel, x_ND, counts, act, w1, w2, w3=None, b1=None, b2=None, b3=None,
                    gate_N=None):
    """Expert e's FFN on its rows of x_ND (sorted by expert, counts rows each) with every GEMM
    through `kernel` (grouped_fp8_kernel's), out in x's dtype (bf16); autograd runs the
    kernel's own FP8 backward. Weights [E, K, N] as the bank holds them (fp32 masters: the
    kernel quantizes from them, as fp8_matmul does). gate_N: None, or each row's routing gate
    applied inside (moe/row_gates.py)."""
    counts_E = torch.as_tensor(counts, device=x_ND.device)
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)

    def gemm(a_NK, w_EKN, b_EN):
        y = kernel(a_NK.contiguous(), w_EKN.mT.contiguous().mT, offs_E, out_dtype=x_ND.dtype)
        return y if b_EN is None else \
            y + b_EN.to(y.dtype).repeat_interleave(counts_E, 0, output_size=y.shape[0])

    def act_out(h1, h3):
        if gate_N is None:
            return gemm(act(h1, h3), w2, b2)
        y = gemm(weighted_act(act, h1, h3, gate_N), w2, None)
        return y if b2 is None else \
            add_gated_bias(y, b2.repeat_interleave(counts_E, 0, output_size=y.shape[0]), gate_N)

    h1 = gemm(x_ND, w1, b1)
    h3 = gemm(x_ND, w3, b3) if w3 is not None else None
    if act.recompute:   # moe_act: the activation and w2's GEMM run again in backward
        return checkpoint(act_out, h1, h3, use_reentrant=False)
    return act_out(h1, h3)
