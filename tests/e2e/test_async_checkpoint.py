"""checkpoint.async (checkpoint.async_save): DCP writes in the background while training goes on.

- dp2 x ep2 with ZeRO-1 (experts sharded, optimizer state sliced): the async run's losses equal
  the synchronous run's (saving changes nothing), its checkpoints complete, and a resume from
  the async step-4 checkpoint gives steps 5-6 bit-identically.
- kill -9 while a background write is in flight (right after "writing in the background" for
  step 4, on a model large enough that the write takes a while): step 4 never becomes a
  checkpoint, train.resume=true resumes from step 2 and ends with the uninterrupted run's
  losses, bit-identical.
"""
import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.e2e.launch import prepared_cache, run_all
from tests.e2e.test_train import ROOT, TINY, losses, train

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return prepared_cache(tmp_path_factory, "async_cache", TINY)


@pytest.mark.long
def test_async_saves_change_nothing_and_resume_under_ep_and_zero1(tmp_path, cache):
    common = TINY + [f"data.cache_dir={cache}", "train.steps=6", "checkpoint.every=2",
                     "train.eval_every=0", "parallel.dp=2", "parallel.ep=2", "parallel.zero=1"]
    sync, background = tmp_path / "sync", tmp_path / "async"
    results = run_all([(2, common + [f"run.dir={sync}"]),
                       (2, common + [f"run.dir={background}", "checkpoint.async=true"])], tmp_path)
    assert all(code == 0 for code, _ in results), results[1][1][-3000:]
    assert "checkpoint of step 4: writing in the background" in results[1][1]
    assert losses(background) == losses(sync)
    assert sorted(p.parent.name for p in (background / "checkpoints").glob("step_*/COMPLETE")) == \
        ["step_00000004", "step_00000006"]  # checkpoint.keep=2
    ref = losses(background)
    shutil.rmtree(background / "checkpoints" / "step_00000006")
    train(common + [f"run.dir={background}", "checkpoint.async=true", "train.resume=true"], tmp_path, nproc=2)
    assert losses(background) == ref


@pytest.mark.long
def test_kill_during_a_background_write_keeps_the_previous_checkpoint(tmp_path, cache):
    big = [a for a in TINY if not a.startswith(("model.d_model", "model.d_ff", "moe.num_experts"))]
    common = big + ["model.d_model=256", "model.d_ff=1024", "moe.num_experts=8",
                    f"data.cache_dir={cache}", "train.steps=6", "checkpoint.every=2",
                    "train.eval_every=0"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    reference = subprocess.Popen([sys.executable, "train.py", *common, f"run.dir={ref}"], cwd=ROOT,
                                 env=dict(os.environ, TMPDIR=str(tmp_path)),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "train.py", *common, f"run.dir={run}", "checkpoint.async=true"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "checkpoint of step 4: writing in the background" in line:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert reference.wait(timeout=300) == 0
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
    ckpts = run / "checkpoints"
    assert not (ckpts / "step_00000004" / "COMPLETE").exists()
    assert (ckpts / "step_00000002" / "COMPLETE").exists()
    out = train(common + [f"run.dir={run}", "checkpoint.async=true", "train.resume=true"], tmp_path)
    assert "step_00000002" in out.stdout + out.stderr
    assert losses(run) == losses(ref)
