"""run.dir=auto gives every run a new numbered directory; resume picks the newest with a
checkpoint; an explicit run.dir keeps its protection, except for runs that never took a step."""
import json

import pytest
import torch

from trainer.config import ConfigError, load_config, to_dict
from trainer.distributed import DistContext
from trainer.run_dir import prepare_run

CTX = DistContext(0, 1, 0, torch.device("cpu"), "")


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # auto directories live under ./runs


def _fake_checkpoint(run_dir, cfg, step=2):
    ck = run_dir / "checkpoints" / f"step_{step:08d}"
    ck.mkdir(parents=True)
    (ck / "trainer.json").write_text(json.dumps({"step": step, "config": to_dict(cfg)}))
    (ck / "COMPLETE").write_text("")


def test_auto_dirs_are_new_numbered_and_named_after_the_config(tmp_path, capsys):
    first, _ = prepare_run(load_config(), CTX)
    second, _ = prepare_run(load_config(), CTX)
    assert (first.run.dir, second.run.dir) == ("runs/default-001", "runs/default-002")
    assert "run dir: runs/default-002 (run.dir=auto, from step 0)" in capsys.readouterr().out
    toml = tmp_path / "layout_x.toml"
    toml.write_text("[train]\nsteps = 3\n")
    named, _ = prepare_run(load_config(toml), CTX)
    assert named.run.dir == "runs/layout_x-001"
    assert (tmp_path / "runs" / "layout_x-001").is_dir()


def test_auto_resume_takes_the_newest_dir_with_a_checkpoint(tmp_path, capsys):
    cfg = load_config(None, ["train.resume=true"])
    fresh, start = prepare_run(cfg, CTX)
    assert start is None and fresh.run.dir == "runs/default-001"
    assert "train.resume=true, but no runs/default-NNN holds a complete checkpoint: starting " \
           "from scratch" in capsys.readouterr().out
    _fake_checkpoint(tmp_path / "runs" / "default-001", cfg)
    (tmp_path / "runs" / "default-002").mkdir()   # newer, but no checkpoint
    resumed, start = prepare_run(cfg, CTX)
    assert resumed.run.dir == "runs/default-001" and start.name == "step_00000002"


def test_explicit_resume_without_checkpoint_says_so(tmp_path, capsys):
    _, start = prepare_run(load_config(None, [f"run.dir={tmp_path / 'x'}", "train.resume=true"]), CTX)
    assert start is None
    assert f"run.dir={str(tmp_path / 'x')!r} holds no complete checkpoint: starting from scratch" \
        in capsys.readouterr().out


def test_explicit_dir_refused_only_after_a_step(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")            # a run that failed before its first step
    cfg = load_config(None, [f"run.dir={run}"])
    assert prepare_run(cfg, CTX)[1] is None
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"already holds a run; pass train.resume=true"):
        prepare_run(cfg, CTX)


def test_run_name_must_be_plain():
    from trainer.config import validate
    with pytest.raises(ConfigError, match=r"run\.name='a/b' must be a plain name"):
        validate(load_config(None, ["run.name=a/b"]), 1)


def test_a_run_that_fails_before_step_1_leaves_no_auto_dir(tmp_path, capsys):
    from trainer.run import run
    empty = tmp_path / "empty_texts"
    empty.mkdir()
    cfg = load_config(None, [f"data.source={empty}", f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError, match="data preparation failed.*holds no text files"):
        run(cfg)
    assert "run dir: runs/default-001" in capsys.readouterr().out  # it was made, then removed
    assert not (tmp_path / "runs" / "default-001").exists()
    # a directory holding anything else (or a run) is kept
    from trainer.run_dir import remove_unused_auto_dir
    kept = tmp_path / "runs" / "default-002"
    kept.mkdir(parents=True)
    (kept / "notes.txt").write_text("mine")
    (kept / "config.toml").write_text("")
    remove_unused_auto_dir(kept)
    assert (kept / "notes.txt").exists() and not (kept / "config.toml").exists()
    ran = tmp_path / "runs" / "default-003"
    _fake_checkpoint(ran, cfg)
    remove_unused_auto_dir(ran)
    assert (ran / "checkpoints").is_dir()
