"""Tolerances that follow from the arithmetic, not from one machine's kernels.

The rule, used by every test that compares results computed in reduced precision (bf16, fp16,
fp8) and by fp32 tests whose difference is summation order only:

1. Two computations of the same maths may round differently wherever the CPU's kernels differ
   (oneDNN picks AMX, AVX512-bf16 or AVX2 kernels by CPU; each blocks its sums its own way).
   A tolerance is therefore a function of the dtype's unit roundoff u (`unit_roundoff`) and of
   the length of the reductions and the number of roundings in between, never a figure read
   off one run.
2. A sum of n terms of one sign, added in any order in a dtype of unit roundoff u, is within
   lam * sqrt(n) * u of the exact sum, relative, with probability at least
   1 - 2n exp(-lam^2 / 2) (Higham and Mary, "A new approach to probabilistic rounding error
   analysis", SIAM J. Sci. Comput. 2019, Theorem 2.4); with lam = 8 that is 1 - 3e-9 at
   n = 1e5. Two such sums differ by at most twice that (`sum_rtol`).
3. A value that is one rounding to the dtype of an exact or fp32-accumulated result may land
   on either neighbour: two of them differ by up to 2u relative per rounding on the path
   (`rounding_rtol`).
4. Training in bf16 compounds this: once two runs' fp32 masters differ by any fp32 rounding
   (a sum order), a bf16 parameter may round to its other neighbour, and every step after it
   differs by a bf16 rounding of a weight, which is as large as the bugs the tests hunt (one
   extra rounding of the masters). A multi-step proof in reduced precision therefore starts
   every step of the reference from the layout's own state (`tests/dist/test_param_dtype.py`:
   the reference performs the same operations on the same weights, and each step is checked
   with the bounds above), or it states a drift bound that holds for any rounding (a few u of
   the low dtype, the end-to-end tests that compare losses only).
5. Adam amplifies rounding even in fp32: a gradient element near zero becomes a step of +-lr
   whose sign the kernels' rounding decides, so two correct fp32 runs of a few steps drift
   apart by far more than fp32's u (tests/dist/test_real_attention.py: 1.6e-4 on a grad norm
   at step 4 on one CPU, under the bound another CPU had measured). A multi-step proof that
   must be tight runs its training steps in fp64 (`dense_common.train_layout(dtype=...)`,
   `reference_run(dtype=...)`; parallel/grads.py sums an fp64 norm in fp64), where the same
   amplification of fp64 rounding stays far below any bound, and states what stays fp32
   inside the layout (a pipeline's loss sum, ring attention's softmax statistics).

`.ci/run` runs the tests marked `lowp` a second time under other kernels
(ONEDNN_MAX_CPU_ISA=AVX2 with ATEN_CPU_CAPABILITY=avx2, and ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16,
the kernels of a CPU with avx512_bf16 and no AMX), so a tolerance tuned to one CPU fails there
first.
"""
import math

import torch

LAMBDA = 8.0  # rule 2: the probabilistic bound's confidence parameter


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: half the gap between 1 and the next number (fp32 2^-24, bf16 2^-8, fp16 2^-11)."""
    return torch.finfo(dtype).eps / 2


def sum_rtol(n: int, dtype: torch.dtype = torch.float32, lam: float = LAMBDA) -> float:
    """Relative difference allowed between two sums of the same n terms of one sign, added in
    different orders in `dtype` (rule 2)."""
    return 2 * lam * math.sqrt(max(n, 1)) * unit_roundoff(dtype)


def rounding_rtol(dtype: torch.dtype, roundings: int = 1) -> float:
    """Relative difference allowed between two results of the same maths that each pass
    through `roundings` roundings to `dtype` (rule 3)."""
    return 2 * roundings * unit_roundoff(dtype)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b| (b the reference), in float64 on the CPU (a tensor on any
    device, of any float dtype); 1e-12 keeps an all-zero reference finite."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))
