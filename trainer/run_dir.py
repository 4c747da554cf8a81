"""Deciding what a run directory means before anything is written into it.

run.dir=auto (the default): every run gets a new directory runs/<run.name>-NNN (001, 002, ...),
created atomically by rank 0 and broadcast, so the same command can run again and keeps
every earlier run; with train.resume=true it is the newest such directory holding a complete
checkpoint. An explicit run.dir that already holds a run (a complete checkpoint or a metrics
record) is only touched with train.resume=true (continue; the checkpoint must fit this
config) or run.overwrite=true (start over). Everything else is an error, so a typo never
destroys a run. A run that failed before its first step left nothing to protect.
"""
import dataclasses
import re
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from . import checkpoint, lock, membership
from .config import ConfigError, to_dict

AUTO = "auto"
AUTO_ROOT = Path("runs")


def holds_run(run_dir: Path) -> bool:
    return bool(checkpoint.list_complete(run_dir)) or _has_records(run_dir / "metrics.jsonl")


def _has_records(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False


def prepare_run(cfg, ctx):
    """(cfg with run.dir resolved, the checkpoint to resume from or None); prints the run dir
    on rank 0. Every rank gets rank 0's choice; ConfigError on every rank for a bad run.dir.
    Rank 0 then holds run.dir's lock (trainer/lock.py; release it with lock.release)."""
    auto = cfg.run.dir == AUTO
    if auto:
        path = _on_main(ctx, lambda: str(_auto_dir(cfg)))
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=path))
    # before anything reads or moves checkpoints: one live run per directory (rank 0 holds it)
    _on_main(ctx, lambda: lock.acquire(cfg.run.dir),
             lambda e: f"cannot create run.dir={cfg.run.dir!r} or its lock: {e}; choose a writable path")
    # rank 0 alone reads (verifies, moves aside) the checkpoints; the others take its answer
    try:
        found = _on_main(ctx, lambda: str(plan_start(cfg, ctx.world_size) or ""),
                         lambda e: f"cannot read the checkpoints in run.dir={cfg.run.dir!r}: {e}")
    except ConfigError:
        if ctx.is_main:
            lock.release(cfg.run.dir)
        raise
    resume_from = Path(found) if found else None
    if ctx.is_main:
        how = "run.dir=auto, " if auto else ""
        how += f"resuming {resume_from.name}" if resume_from else "from step 0"
        print(f"run dir: {cfg.run.dir} ({how})", flush=True)
        if cfg.train.resume and resume_from is None:
            where = (f"no {AUTO_ROOT}/{_name(cfg)}-NNN holds a" if auto
                     else f"run.dir={cfg.run.dir!r} holds no")
            print(f"train.resume=true, but {where} complete checkpoint: starting from scratch",
                  flush=True)
    return cfg, resume_from


def _name(cfg) -> str:
    return cfg.run.name or "default"


def _numbered(cfg) -> list:
    """Existing auto directories of this run name as (number, path), oldest first."""
    pattern = re.compile(re.escape(_name(cfg)) + r"-(\d{3,})")
    if not AUTO_ROOT.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in AUTO_ROOT.iterdir()
             if (m := pattern.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def _auto_dir(cfg) -> Path:
    """The newest directory with a checkpoint (train.resume=true), else a new numbered one.
    mkdir without exist_ok reserves the name, so concurrent runs never share a directory."""
    existing = _numbered(cfg)
    if cfg.train.resume:
        for _, path in reversed(existing):
            if checkpoint.latest(path) is not None:
                return path
    AUTO_ROOT.mkdir(parents=True, exist_ok=True)
    n = existing[-1][0] + 1 if existing else 1
    while True:
        path = AUTO_ROOT / f"{_name(cfg)}-{n:03d}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1


def _on_main(ctx, decide, on_os_error=None):
    """Run `decide()` on rank 0 and give its result (or its error, as ConfigError) to every rank."""
    box = [None, None]
    if ctx.is_main:
        try:
            box[0] = decide()
        except ConfigError as e:
            box[1] = str(e)
        except OSError as e:
            box[1] = (on_os_error or (lambda e: f"cannot create a run directory under {AUTO_ROOT}/: "
                                               f"{e}; set run.dir to a writable path"))(e)
    if ctx.distributed:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise ConfigError(box[1])
    return box[0]


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
        what = f"a checkpoint ({last.name})" if last else "a run"
        raise ConfigError(f"run.dir={cfg.run.dir!r} already holds {what}; pass train.resume=true to "
                          f"continue it, run.overwrite=true to start over, or another run.dir "
                          f"(run.dir=auto: a new {AUTO_ROOT}/{_name(cfg)}-NNN)")
    if last is None:
        return None  # a run that died before its first checkpoint: start again
    rejected = []
    last = checkpoint.newest_good(run_dir, say=lambda line: (rejected.append(line), _warn(line)))
    if last is None:
        raise ConfigError(f"no checkpoint in {checkpoint.checkpoint_root(run_dir)} verifies (they "
                          f"are now in {checkpoint.REJECTED}/); run.overwrite=true starts over")
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


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


# what a run writes before its first step (besides the lock, released before this is used)
_BEFORE_FIRST_STEP = ("config.toml", "metrics.jsonl", membership.FILE)


def remove_unused_auto_dir(run_dir: Path) -> None:
    """A run.dir=auto directory made by a run that failed before its first step (no data, a
    bad layout): removed, so failures do not leave empty runs/<name>-NNN behind. Only files
    this run wrote before step 1 are removed; anything else keeps the directory."""
    if holds_run(run_dir):
        return
    for name in _BEFORE_FIRST_STEP:
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "tb", ignore_errors=True)
    try:
        run_dir.rmdir()
    except OSError:
        pass  # something else is in it: keep it


def clear_run(run_dir: Path) -> None:
    """run.overwrite=true: remove what a previous run wrote (only our own files)."""
    shutil.rmtree(checkpoint.checkpoint_root(run_dir), ignore_errors=True)
    shutil.rmtree(run_dir / "tb", ignore_errors=True)
    for name in ("metrics.jsonl", "config.toml", membership.FILE):
        (run_dir / name).unlink(missing_ok=True)
