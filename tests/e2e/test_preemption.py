"""Preemption: SIGTERM to the torchrun launcher (which passes it to its workers) lets every
rank finish the step it is in, save a checkpoint at that step and exit 143 with one line;
train.resume=true then continues at the next step, so no step is lost or repeated."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.test_train import ROOT, TINY, cache, records, train  # noqa: F401 - cache is a fixture

pytestmark = pytest.mark.e2e


def _wait_for_steps(run, n, proc, limit_s=240):
    path = run / "metrics.jsonl"
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"training ended early: {proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {limit_s}s")


def test_sigterm_saves_at_the_current_step_and_resume_loses_nothing(tmp_path, cache):
    run = tmp_path / "run"
    common = TINY + [f"data.cache_dir={cache}", f"run.dir={run}", "parallel.dp=2",
                     "checkpoint.every=0", "checkpoint.at_end=false"]
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "train.py", *common, "train.steps=100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for_steps(run, 3, proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    steps = [r["step"] for r in records(run)]
    last = steps[-1]
    assert steps == list(range(1, last + 1))
    assert f"preempted: stopped by SIGTERM after step {last}; checkpoint" in err, err[-3000:]
    assert proc.returncode != 0
    ckpt = run / "checkpoints" / f"step_{last:08d}"
    assert (ckpt / "COMPLETE").is_file()  # saved although checkpoint.every=0
    assert took < 30, f"{took:.1f}s from SIGTERM to exit"

    more = train(common + ["train.resume=true", f"train.steps={last + 2}"], tmp_path, nproc=2)
    assert f"resuming {ckpt.name}" in more.stdout
    assert [r["step"] for r in records(run)] == list(range(1, last + 3))


def test_second_run_on_a_live_run_dir_is_refused_and_the_lock_goes_with_the_run(tmp_path, cache):
    run = tmp_path / "run"
    common = TINY + [f"data.cache_dir={cache}", f"run.dir={run}", "checkpoint.every=0"]
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    first = subprocess.Popen([sys.executable, "train.py", *common, "train.steps=100000"], cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(run, 2, first)
        second = train(common + ["train.resume=true", "train.steps=100000"], tmp_path, check=False)
        assert second.returncode == 2
        assert f"is in use by a live run: pid {first.pid}, started" in second.stderr, second.stderr
        assert first.poll() is None  # the live run goes on undisturbed
        first.send_signal(signal.SIGTERM)  # one process: the same preemption path
        _, err = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 143 and "preempted: stopped by SIGTERM after step" in err, err[-2000:]
    assert not (run / "run.lock").exists()  # released on the way out
