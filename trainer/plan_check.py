"""log.plan_check: the layout planner's prediction for this run's own layout, beside what the
run measured, in one line after warm-up.

At start-up rank 0 starts `python -m parallel.planner --config RUN_DIR/config.toml --world W
--layout dpN --json [--hw PRESET]` in a process of its own (the planner parallelizes a meta
model inside a fake process group, which cannot share a process with the run's group); it
runs beside the first steps. After warm-up (the step after the second, whose peak memory is
measured: trainer/memory.py) rank 0 prints

    planner check (rank 0's stage, dp1 tp1 pp1 ep1 z0): peak memory 90.9 MB predicted,
    155.5 MB measured (step 2); step time 0.02156 .. 0.02156 ms predicted (h100 preset),
    32.81 ms measured (median of steps 2-30)

(the default config in bf16 on an H100: a model this small is bound by kernel launches and
the allocator's workspaces, which the planner does not model)

and writes the same figures to RUN_DIR/planner_check.json. The step-time bounds are the
planner's (parallel/planner/step_time.py: everything overlapped .. nothing overlapped) for
the GPU preset matched by torch's device name; on a CPU, or a GPU the presets do not know,
there is no hardware model and only memory is compared. The prediction is the planner's,
unchanged: how close it lands is what the line is for.
"""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from .telemetry import preset_for_device

ROOT = Path(__file__).resolve().parents[1]
WAIT_AT_END_S = 120  # a short run waits this long at its last step for the prediction


def enabled(setting: str, device: torch.device) -> bool:
    """log.plan_check: on, off, or auto (on where a GPU preset gives a step-time model)."""
    return setting == "on" or (setting == "auto" and preset_for_device(device) is not None)


class PlanCheck:
    """The planner subprocess and the comparison; rank 0 only."""

    def __init__(self, run_dir: Path, world: int, dp: int, device: torch.device):
        self.run_dir, self.preset = Path(run_dir), preset_for_device(device)
        cmd = [sys.executable, "-m", "parallel.planner", "--config", str(self.run_dir / "config.toml"),
               "--world", str(world), "--layout", f"dp{dp}", "--json"]
        if self.preset:
            cmd += ["--hw", self.preset]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.step_times, self.peaks, self.done = {}, {}, False

    def observe(self, rec: dict) -> None:
        self.step_times[rec["step"]] = rec["step_time_s"]
        if "peak_mem_bytes" in rec:
            self.peaks[rec["step"]] = rec["peak_mem_bytes"]

    def _peak(self, first: int):
        """(step, bytes): the steady state's, the step after the first (the first that starts
        with optimizer state: what the planner predicts), else the first measured."""
        if first + 1 in self.peaks:
            return first + 1, self.peaks[first + 1]
        return min(self.peaks.items()) if self.peaks else None

    def due_line(self, n: int, first: int, last: int):
        """The line once warm-up is over and the prediction is in (waiting for it at the last
        step), else None; at most once."""
        if self.done or n < min(first + 2, last):
            return None
        if self.proc.poll() is None and n < last:
            return None
        try:
            out, err = self.proc.communicate(timeout=WAIT_AT_END_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.done = True
            return f"planner check: no prediction within {WAIT_AT_END_S} s; skipped"
        self.done = True
        if self.proc.returncode != 0:
            why = (err.strip().splitlines() or ["no output"])[-1]
            return f"planner check: the planner could not predict this layout: {why}"
        return self._compare(json.loads(out)["layout"], first)

    def _compare(self, pred: dict, first: int) -> str:
        stage, peak = pred["ranks"][0], self._peak(first)
        measured = {s: t for s, t in self.step_times.items() if s > first}  # the first warms up
        out = {"layout": pred["name"], "predicted_peak_bytes": stage["memory_bytes"]["peak"],
               "measured_peak_bytes": peak[1] if peak else None,
               "measured_peak_step": peak[0] if peak else None,
               "measured_step_s": statistics.median(measured.values()) if measured else None,
               "preset": self.preset}
        line = f"planner check (rank 0's stage, {pred['name']}): peak memory " \
               f"{out['predicted_peak_bytes'] / 1e6:.1f} MB predicted"
        if peak:
            out["peak_measured_over_predicted"] = peak[1] / out["predicted_peak_bytes"]
            line += f", {peak[1] / 1e6:.1f} MB measured (step {peak[0]}; measured/predicted " \
                    f"{out['peak_measured_over_predicted']:.2f})"
        else:
            line += " (not measured: log.peak_mem=false)"
        if self.preset:
            out.update(predicted_step_s_min=pred["step_s_min"], predicted_step_s=pred["step_s"])
            line += f"; step time {pred['step_s_min'] * 1e3:.4g} .. {pred['step_s'] * 1e3:.4g} ms " \
                    f"predicted ({self.preset} preset)"
        else:
            line += "; step time not predicted (no hardware preset for this device)"
        if measured:
            line += f", {out['measured_step_s'] * 1e3:.4g} ms measured (median of steps " \
                    f"{min(measured)}-{max(measured)}"
            if self.preset:
                out["step_measured_over_predicted"] = out["measured_step_s"] / pred["step_s"]
                line += f"; measured/predicted {out['step_measured_over_predicted']:.2f}"
            line += ")"
        (self.run_dir / "planner_check.json").write_text(json.dumps(out, indent=1))
        return line

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
