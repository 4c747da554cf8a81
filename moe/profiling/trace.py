"""Timing profile of one training step: a torch.profiler trace with the MoE phases as named
ranges (moe.router, moe.dispatch, moe.all_to_all, moe.experts, moe.combine,
moe.shared_experts; recorded by moe/layer.py and moe/all_to_all.py) and a breakdown.

Forward ranges are timed directly; the backward is reported as one total (autograd runs
it outside the forward's ranges). moe.all_to_all is nested inside moe.dispatch/combine.
The traced step comes after warm-up steps run without the profiler: the first steps pay for
allocations, lazy initialisation and cold caches (seconds on a CPU, not the steady state).
"""
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

PHASES = ("moe.router", "moe.dispatch", "moe.all_to_all", "moe.experts", "moe.combine",
          "moe.shared_experts")


def trace_step(step_fn, out_dir=None, warmup: int = 2) -> dict:
    """Run `step_fn()` (forward + backward of one batch) `warmup` times, then once more under
    the profiler.

    Returns {"step": the traced step's number (warmup + 1), "warmup": warmup, "step_ms": its
    wall time under the profiler, "untraced_ms": the last warm-up step's wall time (None
    without warm-up), "phases": {name: {"ms": total, "calls": n, "share": of the traced
    step}}}; writes out_dir/trace.json (chrome://tracing or Perfetto) if out_dir.
    """
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0 (untraced steps before the traced one)")
    untraced_ms = None
    for _ in range(warmup):
        t0 = time.perf_counter()
        step_fn()
        untraced_ms = 1e3 * (time.perf_counter() - t0)
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
    return {"step": warmup + 1, "warmup": warmup, "step_ms": step_ms, "untraced_ms": untraced_ms,
            "phases": phases}


def print_breakdown(result: dict, out) -> None:
    untraced = result.get("untraced_ms")
    plain = f"; the last warm-up step took {untraced:.1f} ms without it" if untraced else ""
    print(f"training step {result.get('step', 1)} after {result.get('warmup', 0)} warm-up steps: "
          f"{result['step_ms']:.1f} ms under the profiler (forward + backward{plain})", file=out)
    print(f"{'phase (forward)':22s} {'ms':>9s} {'calls':>6s} {'% step':>7s}", file=out)
    for name in PHASES:
        r = result["phases"].get(name)
        if r is not None:
            print(f"{name:22s} {r['ms']:9.2f} {r['calls']:6d} {100 * r['share']:6.1f}%", file=out)
