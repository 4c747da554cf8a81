"""Smoke test: bench/moe_layer.py --quick runs end to end on a toy size (no timing checks)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_quick_runs():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "moe_layer.py"), "--quick",
           "--tokens", "64", "--reps", "1", "--warmup", "0", "--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for name in ("floor", "moekit", "grouped_mm", "balanced", "fairscale", "hf"):
        assert any(f" {name} " in ln and "x floor" in ln for ln in lines), (name, out.stdout)
    assert any("E sweep" in ln for ln in lines) and sum(ln.startswith("E=") and "grouped_mm" in ln for ln in lines) == 3
