"""train.py on one GPU: the default config on run.device=cuda for 20 steps in bf16 and fp16
(loss finite and falling; peak memory, reserved peak and TFLOP/s on every step), and ZeRO-3
with offload=optimizer on pinned host buffers."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _train(args, tmp_path, nproc=0):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc else [sys.executable]
    out = subprocess.run(head + ["train.py"] + args, cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _losses(run_dir):
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_default_config_on_cuda(precision, tmp_path):
    run = tmp_path / precision
    out = _train(["run.device=cuda", f"parallel.precision={precision}", "train.steps=20",
                  "train.eval_every=0", "checkpoint.every=0", f"run.dir={run}"], tmp_path)
    assert "cuda" in out.stdout + out.stderr
    losses = _losses(run)
    assert len(losses) == 20 and all(l == l and l < 10 for l in losses), losses
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses
    # CUDA telemetry: peak memory on every step, the allocator's reserved peak beside it,
    # and mfu (torch names a GPU the data-sheet table knows, or log.peak_tflops is needed)
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    assert all(0 < r["peak_mem_bytes"] <= r["peak_mem_reserved_bytes"] for r in steps), steps[:2]
    assert all(r["tflops"] > 0 for r in steps)
    # log.plan_check=auto runs on a GPU the presets know: the planner's step-time bounds for
    # this layout beside the measured step
    check = json.loads((run / "planner_check.json").read_text())
    assert check["preset"] in ("h100", "h200") and 0 < check["predicted_step_s_min"] <= check["predicted_step_s"]
    assert check["measured_step_s"] > 0 and check["predicted_peak_bytes"] > 0
    print(precision, check)


def test_zero3_offload_on_cuda_uses_pinned_host_buffers(tmp_path):
    from parallel.data_parallel.offload import host_empty_like, pinning
    assert pinning()
    assert host_empty_like(torch.empty(4, device="cuda")).is_pinned()
    run = tmp_path / "off"
    _train(["run.device=cuda", "parallel.zero=3", "parallel.offload=optimizer", "parallel.zero_prefetch=1",
            "train.steps=6", "train.eval_every=0", "checkpoint.every=0", f"run.dir={run}"], tmp_path, nproc=1)
    ref = tmp_path / "ref"
    _train(["run.device=cuda", "train.steps=6", "train.eval_every=0", "checkpoint.every=0",
            f"run.dir={ref}"], tmp_path)
    a, b = _losses(run), _losses(ref)
    assert len(a) == len(b) == 6
    assert all(abs(x - y) <= 1e-3 * abs(y) for x, y in zip(a, b)), (a, b)


def test_moe_layer_bench_on_one_gpu():
    """bench/moe_layer.py on the GPU, against the HF Mixtral block (its grouped_mm path)."""
    out = subprocess.run([sys.executable, "bench/moe_layer.py", "--quick", "--dtypes", "bf16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert any(l.split()[-4:-3] == ["hf"] or " hf " in l for l in out.stdout.splitlines()), out.stdout[-2000:]
    print(out.stdout)


def test_async_checkpoint_staging_enqueues_pinned_copies_and_fences_the_step():
    """parallel/staging.py on CUDA: stage() returns at once with a Future (the copies run on
    a side stream into pinned buffers, reused by the next save); after fence() an in-place
    update on the current stream cannot reach the copy."""
    import time
    from concurrent.futures import Future
    from parallel.staging import HostStager
    w = torch.randn(64, 1024, 1024, device="cuda")  # 256 MiB
    stager = HostStager()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    staged = stager.stage({"w": w})
    enqueue_s = time.perf_counter() - t0
    stager.fence()
    w.add_(1.0)                       # the optimizer step, on the current stream
    assert isinstance(staged, Future)
    host = staged.result()["w"]
    assert host.is_pinned() and host.device.type == "cpu"
    assert torch.equal(host, (w - 1.0).cpu())
    ptr = host.data_ptr()
    again = stager.stage({"w": w}).result()["w"]
    assert again.data_ptr() == ptr and torch.equal(again, w.cpu())
    assert enqueue_s < 0.05, enqueue_s  # a blocking 256 MiB copy takes longer
