"""run.dir/run.lock: a live holder is refused with its pid, a dead one is taken over."""
import json
import os
import socket
import subprocess
import sys

import pytest

from trainer import lock
from trainer.config import ConfigError


def _write(run_dir, pid, host=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / lock.LOCK).write_text(json.dumps(
        {"pid": pid, "host": host or socket.gethostname(), "started": "2026-01-01 00:00:00"}))


def _holder(run_dir):
    return json.loads((run_dir / lock.LOCK).read_text())["pid"]


def test_live_holder_refused_dead_holder_taken_over(tmp_path):
    run = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write(run, other.pid)
        with pytest.raises(ConfigError, match=f"in use by a live run: pid {other.pid}, started"):
            lock.acquire(run)
        assert _holder(run) == other.pid  # untouched
    finally:
        other.kill()
        other.wait()
    assert lock.acquire(run) == run / lock.LOCK  # its process is gone: stale, taken over
    assert _holder(run) == os.getpid()
    lock.release(run)
    assert not (run / lock.LOCK).exists()


def test_other_host_is_refused_with_the_file_to_delete_and_release_keeps_foreign_locks(tmp_path):
    run = tmp_path / "run"
    _write(run, 1, host="elsewhere.invalid")
    with pytest.raises(ConfigError, match=r"on host elsewhere.invalid.*delete .*run.lock"):
        lock.acquire(run)
    lock.release(run)  # not ours: stays
    assert _holder(run) == 1
    (run / lock.LOCK).write_text("{torn")  # a holder that died mid-write
    lock.acquire(run)
    assert _holder(run) == os.getpid()


def test_an_earlier_worker_group_of_the_same_torchrun_job_is_taken_over_on_any_host(tmp_path, monkeypatch):
    """An elastic job's rank 0 can move to another host after a node change: the lock of the
    job's earlier group (same TORCHELASTIC_RUN_ID) is over; another job's lock still refuses."""
    run = tmp_path / "run"
    run.mkdir()
    (run / lock.LOCK).write_text(json.dumps({"pid": 1, "host": "node7.invalid", "started": "x", "job": "moe1"}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "other-job")
    with pytest.raises(ConfigError, match="on host node7.invalid"):
        lock.acquire(run)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "moe1")
    lock.acquire(run)
    holder = json.loads((run / lock.LOCK).read_text())
    assert holder["pid"] == os.getpid() and holder["job"] == "moe1"
