"""What multi-token prediction costs and what it does to the main model (issue 63).

Trains the default config (configs/default.toml: the laptop MoE GPT on the stdlib corpus)
through train.py twice, the same seed and batches, without and with model.mtp_depth=K, and
prints side by side: the main validation loss at the end (and their ratio), the MTP depths'
training losses at the first and the last logged step, and the median step time (and the
MTP run's ratio to the baseline: the extra block, projection and head per depth). The two
runs go one after the other (train.py runs whole): on a shared machine rerun before
trusting a time ratio within a few percent.

    .venv/bin/python bench/mtp_cost.py [--steps 300] [--depth 1] [--out DIR] [k=v ...]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path, steps: int, extra: list) -> list:
    cmd = [sys.executable, "train.py", f"train.steps={steps}", f"run.dir={out}",
           "checkpoint.at_end=false", "log.progress=none", "log.tensorboard=false", *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"train.py failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _median_step(recs: list) -> float:
    return statistics.median(r["step_time_s"] for r in recs[len(recs) // 10:])  # past warm-up


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps of each run")
    p.add_argument("--depth", type=int, default=1, help="model.mtp_depth of the MTP run")
    p.add_argument("--out", help="keep the two run directories here (default: a temp dir)")
    p.add_argument("overrides", nargs="*", help="section.field=value for both runs")
    args = p.parse_args(argv)
    base = Path(args.out or tempfile.mkdtemp(prefix="mtp_cost_"))
    plain = _run(base / "plain", args.steps, args.overrides)
    mtp = _run(base / "mtp", args.steps, args.overrides + [f"model.mtp_depth={args.depth}"])
    val = {name: [r["val_loss"] for r in recs if "val_loss" in r][-1]
           for name, recs in (("plain", plain), ("mtp", mtp))}
    t = {"plain": _median_step(plain), "mtp": _median_step(mtp)}
    print(f"default config, {args.steps} steps, model.mtp_depth={args.depth} against 0 "
          f"(same seed and batches; runs in {base})")
    print(f"  main val_loss at step {args.steps}: {val['mtp']:.4f} with MTP, {val['plain']:.4f} "
          f"without: ratio {val['mtp'] / val['plain']:.4f}")
    for k in range(1, args.depth + 1):
        first, last = mtp[0][f"mtp_loss_{k}"], mtp[-1][f"mtp_loss_{k}"]
        print(f"  mtp_loss_{k}: {first:.4f} at step 1, {last:.4f} at step {args.steps}")
    print(f"  median step time: {t['mtp'] * 1e3:.1f} ms with MTP, {t['plain'] * 1e3:.1f} ms "
          f"without: ratio {t['mtp'] / t['plain']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
