"""`torchrun --standalone --max-restarts 1` (the plain launch most users type) recovers from a
worker killed by PID: the second attempt initialises its process group under keys of its own
in torchrun's shared store (trainer/distributed.py restart_safe_store; before, it hung in gloo's
connectFullMesh), resumes from the newest checkpoint and finishes with the same losses as an
uninterrupted run (bit-identical: same layout, RNG and sampler restored), each step logged once.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.test_train import ROOT, TINY, losses, records, train

pytestmark = pytest.mark.e2e


def _workers(launcher_pid: int) -> list:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(launcher_pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.long
def test_killed_worker_is_restarted_and_the_run_continues(tmp_path):
    cache = tmp_path / "cache"
    common = TINY + [f"data.cache_dir={cache}", "train.steps=60", "checkpoint.every=10",
                     "train.eval_every=0", "log.moe_stats_every=0"]
    ref = tmp_path / "ref"
    train(common + [f"run.dir={ref}", "parallel.dp=2"], tmp_path, nproc=2)

    run = tmp_path / "run"
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "train.py", *common, f"run.dir={run}", "parallel.dp=2", "train.resume=true"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((run / "checkpoints").glob("step_*/COMPLETE")):  # a checkpoint exists
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.2)
        victim = _workers(proc.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=240)
        # the restart itself is quick: a hang would sit in connectFullMesh for the gloo timeout
        assert time.monotonic() - killed < 120, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert f"pid: {victim}" in out and "resuming step_" in out, out[-3000:]
    steps = [r["step"] for r in records(run)]
    assert steps == list(range(1, 61)), steps  # every step once, none lost or doubled
    assert not any("val_loss" in r for r in records(run))  # train.eval_every=0: never
    assert losses(run) == losses(ref)  # bit-identical to the uninterrupted run
