"""Atomic torch.distributed.checkpoint (DCP) saves and resumes, reshardable across layouts.

This file handles the files; what each layout's state looks like in a checkpoint (the
layout-free form) is parallel/state_dict.py's.

Layout of run.dir/checkpoints/step_00000100/:
  DCP files       model and optimizer state (sharded tensors are resharded on load)
  trainer.json    step, scheduler, sampler position, resolved config, world size
  rng_rank<r>.pt  each rank's RNG states (restored only when the world size is unchanged)
  manifest.json   size and sha256 of every file above, so a resume can check them
  COMPLETE        written last, before the rename

A save goes to checkpoints/.tmp-step_.../ and is renamed into place only when every rank
has finished writing, so a crash mid-save leaves a temp dir that is never taken for a
checkpoint; older checkpoints are pruned only after the new one is complete. Every file is
fsync'd before COMPLETE is written, and the directories after the rename, so a power loss
cannot leave a COMPLETE checkpoint with missing data. A resume checks the newest checkpoint
against its manifest (verify) and falls back to an older one; rejected and half-written
step directories are moved to checkpoints/rejected/ (kept for inspection, never loaded).

checkpoint.async (begin_save with background=True): DCP's async_save copies the state to host
memory (pinned buffers, copied beside the next step's compute on CUDA: parallel/staging.py)
and writes it from a thread while training goes on; rank 0 then hashes the files for
the manifest in another thread. finish_save (called by the trainer at the first step boundary
where every rank's write is done, before the next save, at the end and on SIGTERM) declares
it exactly as a synchronous save does, so a kill at any point before leaves only a temp dir.
"""
import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from parallel.staging import HostStager
from parallel.state_dict import (OPTIONAL_PREFIXES, layout_state, set_layout_state,
                                 set_weights_state, weights_state)

from .distributed import all_agree, barrier

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
REJECTED = "rejected"  # checkpoints/rejected/: step dirs moved aside, never loaded or pruned
# Fields that change behaviour but not parameter shapes: a resume may change them.
NON_STRUCTURAL = {"model": {"dropout"},
                  "moe": {"capacity_factor", "eval_capacity_factor", "aux_loss_coef",
                          "z_loss_coef", "jitter", "bias_update_rate",
                          # how the layer runs, not what it holds: same weights and state
                          "experts_impl", "replica_slots", "a2a_overlap_degree", "router_replay",
                          "dispatch_dtype", "dispatch", "max_nodes"}}


def checkpoint_root(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:08d}"


def list_complete(run_dir) -> list:
    """Complete checkpoints, oldest first, as (step, path)."""
    root = checkpoint_root(run_dir)
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / "COMPLETE").is_file() and (p / "trainer.json").is_file():
                out.append((int(m.group(1)), p))
    return sorted(out)


def latest(run_dir):
    done = list_complete(run_dir)
    return done[-1][1] if done else None


def read_trainer_state(path) -> dict:
    return json.loads((Path(path) / "trainer.json").read_text())


def structural_diff(saved_cfg: dict, cfg: dict) -> list:
    """'section.field: saved -> now' for every shape-defining model/moe field that changed."""
    diffs = []
    for section in ("model", "moe"):
        old, new = saved_cfg.get(section, {}), cfg.get(section, {})
        for name in sorted(set(old) | set(new)):
            if name not in NON_STRUCTURAL[section] and old.get(name) != new.get(name):
                diffs.append(f"{section}.{name}: {old.get(name)!r} -> {new.get(name)!r}")
    return diffs


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(ctx, run_dir, step: int, par, optimizer, trainer_state: dict, keep: int) -> Path:
    """Collective: every rank calls it with its parallel.Parallelized `par` and optimizer."""
    return finish_save(ctx, begin_save(ctx, run_dir, step, par, optimizer, trainer_state), keep)


@dataclass
class PendingSave:
    """A checkpoint being written into `tmp`; finish_save makes it `final` once written."""
    step: int
    tmp: Path
    final: Path
    future: object = None  # async_save's Future (None: written already, or nothing to write)

    def written(self) -> bool:
        """This rank's part is on disk (an async write that failed counts: finish raises it)."""
        return self.future is None or self.future.done()


def begin_save(ctx, run_dir, step: int, par, optimizer, trainer_state: dict,
               background: bool = False, group=None, stager=None) -> PendingSave:
    """Collective. Write step's checkpoint into its temp dir: the DCP state synchronously, or
    (background) from a host copy staged here while training goes on (parallel/staging.py:
    `stager`, a HostStager kept across saves, whose fence() the caller runs before the next
    optimizer step), DCP's own collectives running off the main thread on `group` (a gloo
    group of every rank; None in one process). RNG states and trainer.json are written now:
    the checkpoint holds this step's state."""
    final = step_dir(run_dir, step)
    if final.is_dir() and (final / "COMPLETE").is_file():
        return PendingSave(step, final, final)  # this exact step is already saved
    bad = _first_non_finite(par.model)
    if not all_agree(ctx, bad is None):  # never replace (or prune) a good checkpoint with this
        raise ValueError(f"refusing to save a checkpoint at step {step}: non-finite weights"
                         + (f" in {bad}" if bad else " on another rank"))
    tmp = final.with_name(".tmp-" + final.name)
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(ctx)
    # this rank's own files first: rank 0 hashes the directory once its DCP future is done,
    # which needs every rank's DCP writes, each begun after that rank's files were written
    write_rank_files(tmp, ctx.rank)
    if ctx.is_main:
        state = dict(trainer_state, step=step, world_size=ctx.world_size)
        _write_synced(tmp / "trainer.json", json.dumps(state, indent=1))
    future = None
    with _quiet_single_process(ctx):
        if not background:
            dcp.save(layout_state(par, optimizer), checkpoint_id=str(tmp))
        else:
            future = dcp.async_save(layout_state(par, optimizer), checkpoint_id=str(tmp),
                                    process_group=group, no_dist=not ctx.distributed,
                                    async_stager=stager or HostStager())
            # a staging still in flight (CUDA copies) makes DCP answer with both futures
            future = getattr(future, "upload_completion", future)
    if ctx.is_main and future is not None:  # hash off the main thread too
        future = _then(future, lambda: _manifest(tmp))
    return PendingSave(step, tmp, final, future)


def write_rank_files(tmp: Path, rank: int) -> None:
    """The files this rank adds to a checkpoint besides DCP's: its RNG states, synced."""
    rng_file = tmp / f"rng_rank{rank}.pt"
    torch.save(_rng_state(), rng_file)
    _fsync_file(rng_file)


def _then(future, fn):
    """A Future of fn() run in a thread once `future` has succeeded (its error otherwise)."""
    out = Future()

    def run():
        try:
            future.result()
            out.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(e)
    threading.Thread(target=run, name="moekit-checkpoint-manifest", daemon=True).start()
    return out


def finish_save(ctx, pending: PendingSave, keep: int) -> Path:
    """Collective. Wait for the write, then declare it: manifest, COMPLETE, the rename into
    place, pruning beyond `keep`. Until then the previous checkpoint stays the newest."""
    if pending.tmp == pending.final:
        return pending.final
    manifest = None
    if pending.future is not None:
        manifest = pending.future.result()  # this rank's files are written (or its error raised)
    final, tmp, run_dir = pending.final, pending.tmp, pending.final.parent.parent
    barrier(ctx)  # every rank's files are written before the checkpoint is declared complete
    if ctx.is_main:
        manifest = manifest or _manifest(tmp)  # _sha256 also fsyncs every file
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1))
        _write_synced(tmp / "COMPLETE", f"{pending.step}\n")
        _fsync_dir(tmp)
        if final.exists():  # a step dir without COMPLETE (a copy, an old crash): keep it aside
            move_aside(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        for _, old in list_complete(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in final.parent.glob(".tmp-step_*"):  # left by an earlier crash
            shutil.rmtree(stale, ignore_errors=True)
    barrier(ctx)
    return final


def _first_non_finite(model):
    """The name of the first parameter (this rank's part of it) holding inf or NaN, or None."""
    for name, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        if not bool(torch.isfinite(t.detach()).all()):
            return name
    return None


@contextlib.contextmanager
def _quiet_single_process(ctx):
    """DCP warns that it assumes one process when there is no process group: that is intended.
    And it warns on every ZeRO-1/2 piece that ShardedTensor is deprecated: those pieces are
    how the slices are described (parallel/data_parallel/zero_shards.py; torch is pinned)."""
    with warnings.catch_warnings():
        if not ctx.distributed:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:  # fsync needs no write access; it flushes the file's pages
        os.fsync(f.fileno())


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        os.fsync(f.fileno())  # every rank's DCP files reach the disk before COMPLETE exists
    return h.hexdigest()


def _manifest(ckpt: Path) -> dict:
    """{file name: {"bytes", "sha256"}} of every file of the checkpoint but the marker files."""
    files = sorted(p for p in ckpt.iterdir() if p.is_file() and p.name not in (MANIFEST, "COMPLETE"))
    return {"files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}}


def verify(ckpt) -> str:
    """'' when the checkpoint is complete and every file matches its manifest, else one line
    naming the first wrong file. A checkpoint from before manifests is only checked for its
    COMPLETE marker and a readable trainer.json."""
    ckpt = Path(ckpt)
    if not (ckpt / "COMPLETE").is_file():
        return f"{ckpt / 'COMPLETE'} is missing (the save did not finish)"
    listed = {}
    if (ckpt / MANIFEST).exists():
        try:
            listed = json.loads((ckpt / MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{ckpt / MANIFEST} is unreadable ({type(e).__name__})"
    for name, want in listed.items():
        path = ckpt / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, the manifest says {want['bytes']}"
        if _sha256(path) != want["sha256"]:
            return f"{path} does not match its sha256 in the manifest (corrupted)"
    try:
        json.loads((ckpt / "trainer.json").read_text())
    except (OSError, ValueError) as e:
        return f"{ckpt / 'trainer.json'} is unreadable ({type(e).__name__})"
    return ""


def move_aside(path: Path) -> Path:
    """Move a bad or half-written step dir to checkpoints/rejected/ (a fresh name there)."""
    dest_root = path.parent / REJECTED
    dest_root.mkdir(exist_ok=True)
    n, dest = 0, dest_root / path.name
    while dest.exists():
        n += 1
        dest = dest_root / f"{path.name}.{n}"
    os.replace(path, dest)
    return dest


def newest_good(run_dir, say=print, move: bool = True):
    """The newest checkpoint that verifies, or None. Newer ones that do not verify (and
    step dirs without COMPLETE) are named, one line each to `say`, and with `move` (rank 0
    only) moved aside, so training past them saves those steps afresh."""
    root = checkpoint_root(run_dir)
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))) \
        if root.is_dir() else []
    for _, path in reversed(steps):
        problem = verify(path)
        if not problem:
            return path
        where = f"; moved to {move_aside(path)}" if move else ""
        say(f"checkpoint {path.name} rejected: {problem}{where}")
    return None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load(ctx, path, par, optimizer) -> dict:
    """Collective: load model/optimizer in place (resharding as needed); returns trainer.json.
    Under ZeRO-1/2 the optimizer slices and the master slices are refreshed from what was
    loaded."""
    path = Path(path)
    if not _has_optimizer_state(path):  # saved before the first optimizer step (e.g. fp16 skips)
        load_model_weights(path, par)
        return _restore_rng(ctx, path)
    state = layout_state(par, optimizer, for_load=True)
    _drop_absent_optional(state, path)
    # each rank saved its own param_groups under the same keys (a pipeline stage lists its own
    # parameters), so the loaded lists are one rank's: keep this rank's, take the values
    mine = [list(g["params"]) for g in state["optim"].get("param_groups", [])]
    with _quiet_single_process(ctx):
        dcp.load(state, checkpoint_id=str(path))
    for group, params in zip(state["optim"].get("param_groups", []), mine):
        group["params"] = params
    set_layout_state(par, optimizer, state)
    return _restore_rng(ctx, path)


def _drop_absent_optional(state: dict, path: Path) -> None:
    """Entries only some layouts save (2bw's pending gradient) are loaded when the
    checkpoint has them: a 2bw run resumed from another schedule's checkpoint starts
    without one."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model = state["model"]
    for k in [k for k in model if k.startswith(OPTIONAL_PREFIXES) and f"model.{k}" not in saved]:
        del model[k]


def _has_optimizer_state(path: Path) -> bool:
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    return any(k.startswith("optim.state.") for k in meta.state_dict_metadata)


def load_model_weights(path, par) -> Path:
    """Model weights only (no optimizer, no RNG), from a run dir (its latest complete
    checkpoint) or a checkpoint dir, into `par.model` (one process or any layout)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist; pass a run dir or a checkpoints/step_XXXXXXXX dir")
    if checkpoint_root(path).is_dir():
        found = newest_good(path, say=lambda line: warnings.warn(line), move=False)
        if found is None:
            raise ValueError(f"{checkpoint_root(path)} holds no complete checkpoint")
        path = found
    if not (path / "COMPLETE").is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no COMPLETE marker); pass a run "
                         f"dir or a checkpoints/step_XXXXXXXX dir")
    state = {"model": weights_state(par)}
    with warnings.catch_warnings():  # DCP notes it assumes one process: intended here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        dcp.load(state, checkpoint_id=str(path))
    set_weights_state(par, state["model"])
    return path


def _restore_rng(ctx, path) -> dict:
    info = read_trainer_state(path)
    rng_file = path / f"rng_rank{ctx.rank}.pt"
    if info.get("world_size") == ctx.world_size and rng_file.is_file():
        try:
            rng = torch.load(rng_file, weights_only=True)
        except Exception:  # noqa: BLE001 - any unreadable file: name it, not pickle internals
            raise ValueError(f"{rng_file} is unreadable (not an RNG state saved by torch.save); "
                             f"restore it or resume from an older checkpoint") from None
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return info
