"""The dtype sums and statistics run in: one rule for the whole toolkit."""
import torch

__all__ = ["accumulation_dtype"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision values, the values' own dtype for fp32 and fp64 (an fp64 proof
    stays fp64): what a reduction over low-precision values accumulates in."""
    return torch.promote_types(dtype, torch.float32)
