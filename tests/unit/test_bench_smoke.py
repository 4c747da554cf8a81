"""Smoke tests: bench scripts run end to end on toy sizes (no timing checks)."""
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


def test_replication_bench_quick_runs():
    """bench/replication.py --quick at ep=2: replicas bring max/mean rows per rank under 1.10
    from >= 1.5, move some bytes, and leave the outputs exactly as without replicas."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "replication.py"), "--quick", "--eps", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {int(ln.split()[1]): ln.split() for ln in out.stdout.splitlines()
            if ln.split()[:1] == ["2"] and len(ln.split()) == 11}
    assert sorted(rows) == [0, 1, 2], out.stdout
    assert float(rows[0][2]) >= 1.5 and float(rows[0][3]) == float(rows[0][2]), out.stdout
    for R in (1, 2):
        assert float(rows[R][3]) <= 1.10 and float(rows[R][4]) > 0, out.stdout
        assert float(rows[R][10]) == 0.0, out.stdout


def test_pipeline_bubble_bench_runs():
    """bench/pipeline_bubble.py on a toy size (1f1b only, one spawn): the planner's predicted
    bubble for pp=2 m=2 and an idle fraction per stage between 0 and 1."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "pipeline_bubble.py"), "--mbs", "2",
           "--steps", "1", "--d-model", "32", "--schedules", "1f1b"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.split()[:1] == ["1f1b"]]
    assert len(rows) == 1 and float(rows[0][2]) == 0.33, out.stdout
    assert len(rows[0]) == 6 and all(0.0 <= float(v) <= 1.0 for v in rows[0][3:]), out.stdout


def test_fp8_bench_quick_runs():
    """bench/fp8.py --quick: bf16 and fp8 (rowwise) runs of the default config through
    train.py's code path in one process, fp8's speed over bf16's printed, and the one account
    of the kernels this machine must give, decided here from the machine (moe/fp8.py
    device_fp8_kernels): the header naming them, the banks' line (on a CPU: all emulated), and
    only without FP8 matmuls the line saying the ratio is the emulation's cost."""
    import torch

    from moe.fp8 import device_fp8_kernels
    cmd = [sys.executable, os.path.join(ROOT, "bench", "fp8.py"), "--quick"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    row = next(ln.split() for ln in lines if ln.startswith("default "))
    bf16, fp8, speed = (float(v) for v in row[1:4])
    assert bf16 > 0 and fp8 > 0 and abs(speed - fp8 / bf16) < 0.01, out.stdout
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    k = device_fp8_kernels(device)
    header = (f"device {device.type}, fp8_recipe=rowwise: Linears' FP8 matmuls "
              f"{'real' if k.matmul else 'emulated'}, expert banks' rowwise GEMMs "
              f"{'real' if k.rowwise else 'emulated'}; median of steps 2..3 of each train.py run")
    assert lines[0] == header, out.stdout
    assert any(ln.startswith("  default: fp8 rowwise: ") for ln in lines), out.stdout
    emulation = "on this device the ratio is the emulation's cost; FP8's speed-up is a GPU figure"
    assert (lines[-1] == emulation) is (not k.matmul), out.stdout


def test_gpu_step_bench_quick_runs():
    """bench/gpu_step.py --quick (eager only): the MoE and its dense twin each trained through
    train.py's run, a row each, the MoE's tokens/s as a fraction of the twin's (on a CPU:
    no MFU, no allocator peak)."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu_step.py"), "--quick", "--modes", "eager"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {ln.split()[0]: ln.split() for ln in out.stdout.splitlines()
            if ln.split()[:2] in (["dense", "eager"], ["moe", "eager"])}
    assert sorted(rows) == ["dense", "moe"], out.stdout
    dense_tps, moe_tps = float(rows["dense"][2]), float(rows["moe"][2])
    assert abs(float(rows["moe"][7]) - moe_tps / dense_tps) < 0.02, out.stdout
