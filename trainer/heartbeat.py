"""Hang detection: a rank that stops answering stops the job within run.hang_timeout_s, named.

A rank frozen whole (SIGSTOP, a process stopped by the kernel or a debugger, a machine that
stopped answering) leaves its peers blocked in their next collective until the process-group
timeout (run.dist_timeout_s, 300 s), and the rank that then fails first is a healthy one.
Lowering that timeout is no cure: legitimately slow work (a checkpoint save, an evaluation,
the first step's compile) would trip it.

Every rank runs a side thread that, every hang_timeout_s / 6:
  - beats: increments its counter `hb/beat/<rank>` in the job's rendezvous store (the store of
    this restart attempt, trainer/distributed.py; torchrun's agent hosts it, so it outlives any
    worker);
  - watches the next rank's counter ((rank + 1) mod world: every rank is watched by one peer,
    each rank reads one counter, O(world) store traffic in all), and reads `hb/hung`.
The thread runs whatever the main thread does (it waits in a collective, writes a checkpoint,
compiles), so only a process that is frozen as a whole stops beating. When a watched counter
has not moved for hang_timeout_s, the watcher writes one line naming that rank, its host and
pid to `hb/hung`; every rank that reads it (or finds it first) prints the line, records it as
its error for torchrun's root-cause summary (trainer/launcher.py), and exits at once with
HANG_EXIT: its main thread is blocked in a collective, so nothing short of os._exit ends it.

A stopped process cannot act on the SIGTERM torchrun sends the group: the agent waits 30 s,
then SIGKILLs it. A rank on the same host as the silent one kills it (SIGKILL) before exiting,
so a restart (torchrun --max-restarts) finds it gone at once; on another host the agent's
SIGKILL does it. A live process whose main thread is stuck (a kernel that never returns) keeps
beating: that case is left to the collective timeout.
"""
import os
import signal
import socket
import sys
import threading
import time

HANG_EXIT = 4
_PREFIX = "moekit/hb"


class Heartbeat:
    """Start with start(); stop(). `act(line)` is what a detected hang does (default: say it,
    record it, kill a same-host silent rank, os._exit(HANG_EXIT)); injectable for tests."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, act=None,
                 clock=time.monotonic):
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.interval = max(0.05, timeout_s / 6)
        self.clock, self.act = clock, act or exit_on_hang
        self.watched = (rank + 1) % world
        self._stop = threading.Event()
        self._thread = None
        self._seen, self._since = None, None

    def start(self) -> "Heartbeat":
        self.store.set(f"{_PREFIX}/who/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="moekit-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _beat(self) -> None:
        self.store.add(f"{_PREFIX}/beat/{self.rank}", 1)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                line = self.check()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return
            if line:
                self.act(line)
                return

    def check(self):
        """The hang line once a hang is known (found here or posted by a peer), else None."""
        if self.store.check([f"{_PREFIX}/hung"]):
            return self.store.get(f"{_PREFIX}/hung").decode()
        if self.world < 2:
            return None
        now, count = self.clock(), self.store.add(f"{_PREFIX}/beat/{self.watched}", 0)
        if count != self._seen:
            self._seen, self._since = count, now
            return None
        if now - self._since < self.timeout_s:
            return None
        line = self._describe(self.watched, now - self._since)
        # the first line posted wins: every rank reports the same one
        self.store.compare_set(f"{_PREFIX}/hung", "", line)
        return self.store.get(f"{_PREFIX}/hung").decode()

    def _describe(self, rank: int, silent_s: float) -> str:
        host, pid = _who(self.store, rank)
        return (f"hang: rank {rank} (host {host}, pid {pid}) has not answered for {silent_s:.0f} s "
                f"(run.hang_timeout_s={self.timeout_s:g}): it is stopped or frozen; every rank "
                f"stops (exit {HANG_EXIT}); resume with train.resume=true or torchrun --max-restarts")


def _who(store, rank: int) -> tuple:
    try:
        host, pid = store.get(f"{_PREFIX}/who/{rank}").decode().split()
        return host, int(pid)
    except Exception:  # noqa: BLE001 - the name is a courtesy; the hang is reported anyway
        return "?", 0


def silent_rank(line: str):
    """(host, pid) named by a hang line, or None."""
    try:
        inner = line.split("(host ", 1)[1].split(")", 1)[0]
        host, pid = inner.split(", pid ")
        return host, int(pid)
    except (IndexError, ValueError):
        return None


def exit_on_hang(line: str) -> None:
    """Say it, record it for torchrun's summary, kill the silent rank if it is on this host
    (a stopped process never acts on torchrun's SIGTERM), and exit this process now."""
    from .launcher import record_error_line
    print(line, file=sys.stderr, flush=True)
    record_error_line(line, began_before=True)
    who = silent_rank(line)
    if who is not None and who[0] == socket.gethostname() and who[1] not in (0, os.getpid()):
        try:
            os.kill(who[1], signal.SIGKILL)
        except OSError:
            pass  # already gone, or not ours to kill: the agent's SIGKILL follows
    os._exit(HANG_EXIT)
