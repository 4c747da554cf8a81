"""Sixteen ranks through train.py: a composed layout against one process, with each process's
memory and the wall time.

    python bench/world16.py [--steps 4] [--layout "pp=2 tp=2 cp=2 dp=-1 ep=4 zero=1"]

The default layout uses every dimension that composes at 16 ranks on one pipeline schedule:
2 pipeline stages (1F1B, 2 microbatches) x 2-way tensor parallelism (sequence parallel) x
2-way context parallelism (ring attention) x 2 data-parallel ranks, the experts spread over 4
ranks of each stage (ep=4 of the dp*cp*tp = 8 ranks) and ZeRO-1 optimizer slices over the data
parallel ranks. The same tiny GPT-MoE, seed and global batch run first in one process; the
script exits 1 unless every step's loss and gradient norm agree within 1e-5 relative (the
layouts differ in reduction order only). Memory per process is the peak resident set (VmHWM,
read from /proc every 0.2 s while the workers run) and the toolkit's own peak of live tensors
(log.peak_mem_every=1, metrics.jsonl's peak_mem_bytes, rank 0). Too long for the suite
(about a minute with 16 processes on 2 cores), hence a bench.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64", "moe.num_experts=4",
        "data.seq_len=32", "train.batch_size=8", "data.max_bytes=1000000", "train.eval_every=0",
        "log.moe_stats_every=0", "train.warmup_steps=2", "checkpoint.every=0", "log.peak_mem_every=1"]
TOLERANCE = 1e-5


def _children(pid: int) -> list:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _hwm_kib(pid: int):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _train(args, tmp: Path, nproc: int):
    """Run train.py; (seconds, {worker pid: peak RSS KiB}, output)."""
    head = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                               if nproc > 1 else [])
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    log = open(tmp / f"log{nproc}.txt", "w+")
    start = time.monotonic()
    proc = subprocess.Popen(head + ["train.py", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    peaks = {}
    while proc.poll() is None:
        for pid in (_children(proc.pid) if nproc > 1 else [proc.pid]):
            kib = _hwm_kib(pid)
            if kib:
                peaks[pid] = max(kib, peaks.get(pid, 0))
        time.sleep(0.2)
    seconds = time.monotonic() - start
    log.seek(0)
    out = log.read()
    if proc.returncode != 0:
        sys.exit(f"train.py on {nproc} process(es) failed ({proc.returncode}):\n{out[-3000:]}")
    return seconds, peaks, out


def _steps(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layout", default="pp=2 tp=2 cp=2 dp=-1 ep=4 zero=1",
                    help="parallel.* settings for 16 ranks, space separated")
    args = ap.parse_args()
    layout = [f"parallel.{kv}" for kv in args.layout.split()]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        common = TINY + [f"train.steps={args.steps}", f"data.cache_dir={tmp / 'cache'}"]
        t1, rss1, _ = _train(common + [f"run.dir={tmp / 'one'}"], tmp, 1)
        t16, rss16, out = _train(common + layout + [f"run.dir={tmp / 'w16'}"], tmp, 16)
        one, w16 = _steps(tmp / "one"), _steps(tmp / "w16")
    print(next(line for line in out.splitlines() if line.startswith("moekit:")))
    print(f"{'step':>4} {'loss 1 proc':>12} {'loss 16':>12} {'rel':>9} {'grad_norm rel':>13}")
    worst = 0.0
    for s in sorted(one):
        rel = abs(w16[s]["loss"] - one[s]["loss"]) / abs(one[s]["loss"])
        grel = abs(w16[s]["grad_norm"] - one[s]["grad_norm"]) / abs(one[s]["grad_norm"])
        worst = max(worst, rel, grel)
        print(f"{s:>4} {one[s]['loss']:>12.7f} {w16[s]['loss']:>12.7f} {rel:>9.1e} {grel:>13.1e}")
    peaks = sorted(rss16.values())
    print(f"wall: 1 process {t1:.1f} s, 16 processes {t16:.1f} s (2 shared cores: start-up and gloo "
          f"waits, not a speed figure)")
    print(f"peak RSS per process: 1 process {max(rss1.values()) / 1024:.0f} MiB; 16 processes "
          f"min {peaks[0] / 1024:.0f} / median {peaks[len(peaks) // 2] / 1024:.0f} / max "
          f"{peaks[-1] / 1024:.0f} MiB, {sum(peaks) / 1024 ** 2:.2f} GiB together ({len(peaks)} sampled)")
    last = max(one)
    print(f"live tensors at the peak (rank 0, step {last}): 1 process "
          f"{one[last]['peak_mem_bytes'] / 2 ** 20:.2f} MiB, 16 processes "
          f"{w16[last]['peak_mem_bytes'] / 2 ** 20:.2f} MiB")
    ok = len(one) == len(w16) == args.steps and worst <= TOLERANCE
    print(f"{'OK' if ok else 'FAILED'}: worst relative difference {worst:.1e} (tolerance {TOLERANCE:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
