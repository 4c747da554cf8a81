"""What measuring peak memory costs a CPU training step (log.peak_mem_every).

    python bench/peak_mem_cost.py [--steps 30] [--config configs/default.toml]

Runs train.py on the config twice each way, alternating: with the live-tensor counter on
every step (log.peak_mem_every=1) and with it off (log.peak_mem=false); prints the median
step_time_s of each (the first two steps left out) and their ratio: the cost of one measured
step, which sets trainer/memory.py's CPU_EVERY (every 50th step: a few percent of the run).
On CUDA the allocator keeps its own counters; a measured step costs two synchronizes.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(config: str, steps: int, extra: list) -> list:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", config, f"train.steps={steps}",
               f"run.dir={d}/run", "log.progress=none", "log.tensorboard=false",
               "checkpoint.every=0", "checkpoint.at_end=false", "log.comm_bytes=false",
               "train.eval_every=0", *extra]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
        recs = [json.loads(line) for line in open(f"{d}/run/metrics.jsonl")]
    return [r["step_time_s"] for r in recs if "step_time_s" in r][2:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    on, off = [], []
    for _ in range(2):  # alternate, so drift in machine load hits both alike
        on += run(args.config, args.steps, ["log.peak_mem_every=1"])
        off += run(args.config, args.steps, ["log.peak_mem=false"])
    a, b = statistics.median(on), statistics.median(off)
    print(f"{args.config}: median step {a * 1e3:.1f} ms measured every step, {b * 1e3:.1f} ms "
          f"not measured: a measured step costs {a / b:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
