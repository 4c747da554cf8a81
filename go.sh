#!/usr/bin/env bash
# The two commands of the README:
#   bash go.sh train [train.py args...]   install (once) and run the main job
#   bash go.sh test  [pytest args...]     install (once) and run the whole test suite
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$ROOT/scripts/setup.sh"
PY="${MOEKIT_VENV:-$ROOT/.venv}/bin/python"
cmd="${1:-train}"; shift || true
cd "$ROOT"
case "$cmd" in
  train) exec "$PY" train.py "$@" ;;
  # two pytest workers (pytest-xdist, work stealing): most tests wait on process start-up
  # and gloo, so the 2-core machine runs two at once; MOEKIT_TEST_WORKERS=0 runs serially
  test)  exec "$PY" -m pytest tests -n "${MOEKIT_TEST_WORKERS:-2}" --dist worksteal "$@" ;;
  *) echo "usage: bash go.sh train|test [args...]" >&2; exit 2 ;;
esac
