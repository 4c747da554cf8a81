"""Timing profile of one training step: a torch.profiler trace with the MoE phases as named
ranges (moe.router, moe.dispatch, moe.all_to_all, moe.experts, moe.combine,
moe.shared_experts; recorded by moe/layer.py and parallel/all_to_all.py) and a breakdown.

Forward ranges are timed directly; the backward is reported as one total (autograd runs
it outside the forward's ranges). moe.all_to_all is nested inside moe.dispatch/combine.
"""
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

PHASES = ("moe.router", "moe.dispatch", "moe.all_to_all", "moe.experts", "moe.combine",
          "moe.shared_experts")


def trace_step(step_fn, out_dir=None, warmup: int = 1) -> dict:
    """Run `step_fn()` (forward + backward of one batch) under the profiler.

    Returns {"step_ms": wall time, "phases": {name: {"ms": total, "calls": n, "share": of
    step}}}; writes out_dir/trace.json (open in chrome://tracing or Perfetto) if out_dir.
    """
    for _ in range(warmup):  # first-call costs (allocations, lazy init) are not the step
        step_fn()
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step_fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_ms = 1e3 * (time.perf_counter() - t0)
    phases = {}
    for ev in prof.key_averages():
        if ev.key in PHASES:
            ms = ev.cpu_time_total / 1e3
            phases[ev.key] = {"ms": ms, "calls": ev.count, "share": ms / step_ms}
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(out_dir) / "trace.json"))
    return {"step_ms": step_ms, "phases": phases}


def print_breakdown(result: dict, out) -> None:
    print(f"one training step: {result['step_ms']:.1f} ms (forward + backward)", file=out)
    print(f"{'phase (forward)':22s} {'ms':>9s} {'calls':>6s} {'% step':>7s}", file=out)
    for name in PHASES:
        r = result["phases"].get(name)
        if r is not None:
            print(f"{name:22s} {r['ms']:9.2f} {r['calls']:6d} {100 * r['share']:6.1f}%", file=out)
