#!/usr/bin/env bash
# Creates .venv and installs the project with its dev extra. Idempotent: a second run with
# unchanged pyproject.toml and this script only checks a stamp file and returns.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MOEKIT_VENV:-$ROOT/.venv}"
# torch==2.13.0 is the local CPU build on CPU machines; on a CUDA machine the same pin is
# PyPI's CUDA build. Never leave torch unpinned: that pulls a multi-GB CUDA build on a CPU box.
TORCH_PIN="${MOEKIT_TORCH:-torch==2.13.0}"
STAMP="$VENV/.moekit-stamp"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1) $TORCH_PIN"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "[setup] moekit needs Python 3.11+ (the config loader uses tomllib); python3 here is" \
       "$(python3 -V 2>&1): put a newer python3 first on PATH" >&2
  exit 2
fi
echo "[setup] creating $VENV and installing $TORCH_PIN + moekit[dev] (1.5-2.5 minutes)" >&2
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" "$TORCH_PIN"
# fairscale (dev-only reference peer) builds from an sdist whose setup imports torch.
"${PIP[@]}" --no-build-isolation "fairscale==0.4.13"
"${PIP[@]}" -e "$ROOT[dev]" "$TORCH_PIN"
echo "$WANT" > "$STAMP"
echo "[setup] done" >&2
