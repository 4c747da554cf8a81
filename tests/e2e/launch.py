"""Start several train.py launches at once, a bounded number of processes at a time.

A tiny run spends most of its wall time starting up (importing torch) and, under torchrun,
blocked in gloo waits: two or more such launches overlap well on the 2-core machine. The
outputs are what each run wrote (metrics.jsonl, checkpoints), identical to sequential launches;
only the timings of concurrent runs are not comparable, so nothing that asserts on time
launches this way. Runs that share a data cache must find it prepared (launch one first).
"""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def command(args, nproc: int = 1) -> list:
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone",
                                      f"--nproc-per-node={nproc}"]
    return [sys.executable, *launcher, "train.py", *args]


def run_all(jobs, tmp, max_procs: int = 4, timeout: float = 600) -> list:
    """jobs: [(nproc, args)] -> [(returncode, output)] in job order, starting a job whenever the
    processes running plus its own stay within max_procs (a larger job runs alone)."""
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    pending, running, done = list(enumerate(jobs)), {}, {}
    deadline = time.monotonic() + timeout
    while pending or running:
        busy = sum(jobs[i][0] for i in running)
        while pending and (not running or busy + pending[0][1][0] <= max_procs):
            i, (nproc, args) = pending.pop(0)
            log = open(Path(tmp) / f"launch{i}.log", "w+")
            running[i] = (subprocess.Popen(command(args, nproc), cwd=ROOT, env=env, stdout=log,
                                           stderr=subprocess.STDOUT, text=True), log)
            busy += nproc
        for i, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.seek(0)
                done[i] = (proc.returncode, log.read())
                log.close()
                del running[i]
        if time.monotonic() > deadline:
            for proc, _ in running.values():
                proc.kill()
            raise TimeoutError(f"launches still running after {timeout} s: {sorted(running)}")
        time.sleep(0.1)
    return [done[i] for i in range(len(jobs))]


def prepared_cache(tmp_path_factory, name: str, args) -> Path:
    """A data cache holding the prepared data of a train.py config given by `args` (overrides),
    made in this process: launches started together then only read it."""
    from data.prepare import prepared_dir
    from trainer.config import load_config
    path = tmp_path_factory.mktemp(name)
    prepared_dir(load_config(None, list(args) + [f"data.cache_dir={path}"]).data)
    return path
