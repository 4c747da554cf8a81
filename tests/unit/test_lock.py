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
