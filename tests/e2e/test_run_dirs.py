"""The main job can run twice: without run.dir every run gets its own runs/<name>-NNN, and
train.resume=true continues the newest one. Config errors under torchrun show their one
line in torchrun's failure summary, with exit code 2 for the workers."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_train import ROOT, TINY, records

pytestmark = pytest.mark.e2e


def _run(cmd_args, cwd, cache, torchrun=False):
    env = dict(os.environ, TMPDIR=str(cwd), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] \
        if torchrun else [sys.executable]
    cmd = [*launcher, str(ROOT / "train.py"), *TINY, f"data.cache_dir={cache}", *cmd_args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_same_command_twice_keeps_both_runs_and_resume_takes_the_newest(tmp_path):
    cache = tmp_path / "cache"
    outs = [_run(["train.steps=2"], tmp_path, cache) for _ in range(2)]
    for i, out in enumerate(outs, start=1):
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"run dir: runs/default-00{i} (run.dir=auto, from step 0)" in out.stdout
        run = tmp_path / "runs" / f"default-00{i}"
        assert [r["step"] for r in records(run)] == [1, 2]
        assert (run / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
        assert f'dir = "runs/default-00{i}"' in (run / "config.toml").read_text()
    # the first run's results are untouched by the second
    assert records(tmp_path / "runs" / "default-001")[0]["step"] == 1

    more = _run(["train.steps=3", "train.resume=true"], tmp_path, cache)
    assert more.returncode == 0, more.stderr[-2000:]
    assert "run dir: runs/default-002 (run.dir=auto, resuming step_00000002)" in more.stdout
    assert [r["step"] for r in records(tmp_path / "runs" / "default-002")] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["default-001", "default-002"]


def test_config_error_under_torchrun_is_the_summarys_root_cause(tmp_path):
    out = _run(["parallel.tp=2", "data.seq_len=31", "train.steps=1"], tmp_path,
               tmp_path / "cache", torchrun=True)
    line = "error: data.seq_len=31 is not divisible by parallel.tp=2"
    summary = out.stderr[out.stderr.index("Root Cause"):]
    assert line in summary
    # the workers' exit code for a config error, on at least one worker's entry: under load
    # torchrun may stop the other worker (-15) right after it wrote its error file, and the
    # summary may then name that one the root cause (seen once, 2026-11-27)
    assert "exitcode  : 2" in out.stderr[out.stderr.index("train.py FAILED"):]
    assert out.returncode != 0
    # never repeated beyond rank 0's own line and one summary entry per worker (the root
    # cause always has it, asserted above; under load torchrun may stop the other worker
    # before it writes its line: seen once, a count of 1)
    assert out.stderr.count(line) <= 3
    assert not (tmp_path / "runs").exists()     # checked before any run directory is made


def test_torchrun_ranks_share_rank0s_auto_dir(tmp_path):
    (tmp_path / "runs" / "default-001").mkdir(parents=True)  # taken: the run must use 002
    out = _run(["parallel.dp=2", "train.steps=2"], tmp_path, tmp_path / "cache", torchrun=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("run dir: runs/default-002 (run.dir=auto, from step 0)") == 1  # rank 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["default-001", "default-002"]
    run = tmp_path / "runs" / "default-002"
    assert [r["step"] for r in records(run)] == [1, 2]
    assert (run / "checkpoints" / "step_00000002" / "COMPLETE").is_file()  # written by both ranks
