#!/usr/bin/env bash
# The reduced-precision tests (marker `lowp`, tests/tolerance.py) again under other CPU
# kernels, so that a tolerance tuned to one CPU's kernels fails here first:
#   1. ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2: oneDNN's and ATen's AVX2 kernels
#      (no AVX512, no bf16 dot products, no AMX);
#   2. ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16: the bf16 kernels of a CPU with avx512_bf16 and no
#      AMX (an AMD EPYC of the same machine kind; the kernels that once failed
#      tests/dist/test_param_dtype.py). On a CPU without avx512_bf16 oneDNN takes the best it has.
# Extra arguments go to pytest. Called by .ci/run after the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
for kernels in "ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2" "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"; do
  echo "[other kernels] $kernels: bash go.sh test -m lowp" >&2
  start=$SECONDS
  env $kernels bash go.sh test -m lowp "$@"
  echo "[other kernels] $kernels: $((SECONDS - start)) s" >&2
done
