"""One live run per run.dir: rank 0 holds run.dir/run.lock (its pid, host, start time).

A second run on the same directory would interleave checkpoints and metrics and could move
the first run's newest checkpoint aside while it is being written, so it is refused at once.
A lock whose process is gone (a crash, SIGKILL) is taken over. On another host the pid
cannot be checked: the message says which file to delete if that run is really over --
except for a lock taken by an earlier worker group of the same torchrun job (the same
TORCHELASTIC_RUN_ID): torchrun stops every worker of a group before it starts the next one
(a restart, a node lost or regained), so that holder is over wherever it ran, and an elastic
job whose rank 0 moves to another host takes the lock over.
"""
import json
import os
import socket
import time
from pathlib import Path

from .config import ConfigError

LOCK = "run.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _holder(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # torn or vanished: the writer died mid-write, or just released it


def acquire(run_dir) -> Path:
    """Take run_dir/run.lock for this process (creating run_dir); ConfigError if a live run holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S"), "job": _torchrun_job()}
    for _ in range(3):  # a stale lock is removed, then created afresh (O_EXCL decides races)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            other = _holder(path)
            if other is not None and _live_elsewhere(other, me):
                raise ConfigError(_in_use(run_dir, path, other, me)) from None
            path.unlink(missing_ok=True)  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return path
    raise ConfigError(f"cannot take {path}: other runs keep racing for it; use another run.dir")


def _torchrun_job():
    """This torchrun job's id (its rendezvous id), or None outside torchrun."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    return job if job and job != "none" else None


def _live_elsewhere(other: dict, me: dict) -> bool:
    if me["job"] is not None and other.get("job") == me["job"] and other.get("pid") != me["pid"]:
        return False  # an earlier worker group of this torchrun job: stopped before this one
    if other.get("host") != me["host"]:
        return True  # cannot tell: assume alive
    return other.get("pid") != me["pid"] and _alive(int(other.get("pid", -1)))


def _in_use(run_dir, path, other, me) -> str:
    where = "" if other.get("host") == me["host"] else f" on host {other.get('host')}"
    gone = "" if not where else f" (if that run is over, delete {path})"
    return (f"run.dir={str(run_dir)!r} is in use by a live run: pid {other.get('pid')}{where}, "
            f"started {other.get('started')}{gone}; wait for it to finish or use another run.dir")


def release(run_dir) -> None:
    """Remove run_dir/run.lock if this process holds it."""
    path = Path(run_dir) / LOCK
    other = _holder(path)
    if other is not None and other.get("pid") == os.getpid() \
            and other.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)
