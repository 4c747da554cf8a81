"""Deciding what a run directory means before anything is written into it.

A run.dir that already holds a run (checkpoints or metrics) is only touched with
train.resume=true (continue; the checkpoint must fit this config) or run.overwrite=true
(start over). Everything else is an error, so a typo never destroys a run.
"""
import shutil
from pathlib import Path

from . import checkpoint
from .config import ConfigError, to_dict


def holds_run(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() or checkpoint.checkpoint_root(run_dir).is_dir()


def plan_start(cfg, world_size: int):
    """The checkpoint to resume from (a Path) or None for a fresh start; may raise ConfigError."""
    run_dir = Path(cfg.run.dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir={cfg.run.dir!r} is a file; choose a directory path")
    if cfg.run.overwrite and cfg.train.resume:
        raise ConfigError("run.overwrite=true and train.resume=true contradict each other; pick one")
    if cfg.run.overwrite or not holds_run(run_dir):
        return None
    last = checkpoint.latest(run_dir)
    if not cfg.train.resume:
        what = f"a checkpoint at step {checkpoint.read_trainer_state(last)['step']}" if last else "a run"
        raise ConfigError(f"run.dir={cfg.run.dir!r} already holds {what}; pass train.resume=true to "
                          f"continue it, run.overwrite=true to start over, or another run.dir")
    if last is None:
        return None  # a run that died before its first checkpoint: start again
    saved = checkpoint.read_trainer_state(last)
    diffs = checkpoint.structural_diff(saved.get("config", {}), to_dict(cfg))
    if diffs:
        raise ConfigError(f"the checkpoint {last} was made with a different model, so it cannot be "
                          f"resumed with this config:\n  " + "\n  ".join(diffs) +
                          "\nuse the same model/moe settings, or another run.dir")
    if saved["step"] > cfg.train.steps:
        raise ConfigError(f"the checkpoint {last} is at step {saved['step']}, beyond "
                          f"train.steps={cfg.train.steps}; raise train.steps")
    return last


def clear_run(run_dir: Path) -> None:
    """run.overwrite=true: remove what a previous run wrote (only our own files)."""
    shutil.rmtree(checkpoint.checkpoint_root(run_dir), ignore_errors=True)
    shutil.rmtree(run_dir / "tb", ignore_errors=True)
    for name in ("metrics.jsonl", "config.toml"):
        (run_dir / name).unlink(missing_ok=True)
