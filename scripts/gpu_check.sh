#!/usr/bin/env bash
# Every GPU figure in one call of at most ~9 minutes (ONLY= to fit less) on one H100/H200, each to a file in the
# folder given as the first argument (default gpu_check_out), with a short summary on stdout.
# Needs no network and no install: it runs the project from its folder with the python that
# has torch (PYTHON; default .venv/bin/python, else python3; PYTHONPATH=$PWD). torchao, if carried as a wheel, goes
# first: TORCHAO_WHEEL=path/to/torchao.whl (installed with --no-index into a temp dir).
# Without a GPU it says so at its first GPU-only step and exits 0.
# ONLY="gpu_tier gpu_step" runs just the steps named (all by default).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-gpu_check_out}"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then  # the project's venv where there is one, else the image's python
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "${TORCHAO_WHEEL:-}" ]]; then
  SITE="$(mktemp -d)"
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$TORCHAO_WHEEL" > "$OUT/torchao_install.txt" 2>&1
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
"$PY" - > "$OUT/env.txt" 2>&1 <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PYEOF
cat "$OUT/env.txt"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is false); the GPU steps need one. Exiting 0."
  exit 0
fi
step() {  # step NAME TIMEOUT_S CMD...: runs CMD into $OUT/NAME.txt, prints its last lines
  local name="$1" limit="$2"; shift 2
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then echo "== $name: skipped (ONLY=$ONLY)"; return; fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "== $name: rc=$rc, $((SECONDS - t0)) s (full output: $OUT/$name.txt)"
  tail -n "${TAIL:-6}" "$OUT/$name.txt"
}
# most wanted first: a step that runs past its limit leaves the later ones their time
# the Qwen3-30B-A3B-shaped MoE and its dense twin through train.py, eager and compiled (issue 59)
TAIL=8 step gpu_step 120 "$PY" bench/gpu_step.py --steps 6 --warmup 2
# fp8 (rowwise) against bf16 through train.py, and single banks at four shapes (issue 60)
TAIL=20 step fp8 160 "$PY" bench/fp8.py --steps 6 --warmup 2 --banks
TAIL=12 step gpu_tier 150 "$PY" -m pytest tests/gpu -q -rA -p no:cacheprovider -o addopts="" --timeout 100
TAIL=4 step layer_profile 40 "$PY" bench/layer_profile.py --tokens 16384 --d-model 2048 --d-ff 1024 --experts 16 --top-k 2
TAIL=30 step moe_layer 80 "$PY" bench/moe_layer.py --tokens 16384 --d-model 2048 --d-ff 1024 \
    --dtypes bf16 --ks 2,1 --skip sweep --reps 5 --warmup 2
exit 0
