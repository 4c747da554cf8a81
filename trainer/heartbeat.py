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
SIGKILL does it. The process is identified by more than its pid: each rank posts its host,
pid, pid namespace and start time (`who`), and the killer sends the signal only when the pid
on its own host still has that namespace and start time (containers that share a hostname but
not a pid namespace would otherwise see an unrelated process under that pid). A live process
whose main thread is stuck (a kernel that never returns) keeps beating: that case is left to
the collective timeout.

A rank that finishes marks itself done before its heartbeat stops, after the teardown
barrier (trainer/run.py), so a peer still closing files never reports a finished rank. A store
error is said in one line and retried; after STORE_RETRIES failures in a row the thread says
that hang detection is off for the rest of the run and ends. Under a plain env:// launch rank 0
hosts the store: a frozen rank 0 freezes it, the peers' heartbeat calls fail after the store's
timeout, they say so and detection turns off; the collective timeout (run.dist_timeout_s) then
ends the run. torchrun's agent hosts the store itself, so this case needs env:// or srun.
"""
import os
import signal
import socket
import sys
import threading
import time

HANG_EXIT = 4
STORE_RETRIES = 3
_PREFIX = "moekit/hb"


class Heartbeat:
    """Start with start(); stop(). `act(line)` is what a detected hang does (default: say it,
    record it, kill a same-host silent rank, os._exit(HANG_EXIT)); injectable for tests."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, act=None,
                 clock=time.monotonic):
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.interval = max(0.05, timeout_s / 6)
        self.clock = clock
        self.act = act or (lambda line: exit_on_hang(line, self.silent_who()))
        self.failures, self.hung_rank = 0, None
        self.watched = (rank + 1) % world
        self._stop = threading.Event()
        self._thread = None
        self._seen, self._since = None, None

    def start(self) -> "Heartbeat":
        who = f"{socket.gethostname()} {os.getpid()} {identity(os.getpid()) or '-'}"
        self.store.set(f"{_PREFIX}/who/{self.rank}", who)
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="moekit-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """This rank finished: marked done (its watcher stops counting its silence), then the
        thread ends."""
        try:
            self.store.set(f"{_PREFIX}/done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store is gone with the job: nothing to tell
            pass
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
                self.failures = 0
            except Exception as e:  # noqa: BLE001 - said, retried, then detection is off
                if self._stop.is_set():
                    return  # the job is ending: the store may already be gone
                self.failures += 1
                print(f"rank {self.rank}: hang detection could not reach the rendezvous store "
                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                      + ("retrying" if self.failures < STORE_RETRIES else
                         "hang detection is OFF for the rest of this run (run.dist_timeout_s "
                         "still ends a hung job)"), file=sys.stderr, flush=True)
                if self.failures >= STORE_RETRIES:
                    return
                continue
            if line:
                self.act(line)
                return

    def check(self):
        """The hang line once a hang is known (found here or posted by a peer), else None."""
        if self.store.check([f"{_PREFIX}/hung"]):
            return self._posted()
        if self.world < 2 or self.store.check([f"{_PREFIX}/done/{self.watched}"]):
            return None
        now, count = self.clock(), self.store.add(f"{_PREFIX}/beat/{self.watched}", 0)
        if count != self._seen:
            self._seen, self._since = count, now
            return None
        if now - self._since < self.timeout_s:
            return None
        line = self._describe(self.watched, now - self._since)
        # the first line posted wins: every rank reports the same one (with the rank it names)
        self.store.compare_set(f"{_PREFIX}/hung", "", f"{self.watched}\n{line}")
        return self._posted()

    def _posted(self) -> str:
        """The posted hang line; remembers the rank it names (hung_rank)."""
        rank, line = self.store.get(f"{_PREFIX}/hung").decode().split("\n", 1)
        self.hung_rank = int(rank)
        return line

    def _describe(self, rank: int, silent_s: float) -> str:
        host, pid = _who(self.store, rank)
        return (f"hang: rank {rank} (host {host}, pid {pid}) has not answered for {silent_s:.0f} s "
                f"(run.hang_timeout_s={self.timeout_s:g}): it is stopped or frozen; every rank "
                f"stops (exit {HANG_EXIT}); resume with train.resume=true or torchrun --max-restarts")


    def silent_who(self):
        """(host, pid, identity) the hung rank posted at its start, or None."""
        try:
            host, pid, ident = self.store.get(f"{_PREFIX}/who/{self.hung_rank}").decode().split()
            return host, int(pid), ident
        except Exception:  # noqa: BLE001 - then nothing is killed: the agent's SIGKILL follows
            return None


def identity(pid: int):
    """'pid-namespace-inode:start-time' of process pid on this host, or None (gone, not
    readable, not Linux): what a pid alone cannot tell apart across pid namespaces."""
    try:
        ns = os.stat(f"/proc/{pid}/ns/pid").st_ino
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]   # field 22, after the command name
        return f"{ns}:{start}"
    except (OSError, IndexError):
        return None


def may_kill(who) -> bool:
    """Whether (host, pid, identity) names a process this one may SIGKILL: on this host,
    not this process, and the pid here still has the posted namespace and start time."""
    if who is None:
        return False
    host, pid, ident = who
    return host == socket.gethostname() and pid not in (0, os.getpid()) and ident != "-" \
        and identity(pid) == ident


def _who(store, rank: int) -> tuple:
    try:
        host, pid = store.get(f"{_PREFIX}/who/{rank}").decode().split()[:2]
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


def exit_on_hang(line: str, who=None) -> None:
    """Say it, record it for torchrun's summary, kill the silent rank if it is this host's
    and still the same process (may_kill; a stopped process never acts on torchrun's SIGTERM),
    and exit this process now. who: (host, pid, identity) of the hung rank, or None."""
    from .launcher import record_error_line
    print(line, file=sys.stderr, flush=True)
    record_error_line(line, began_before=True)
    if may_kill(who):
        try:
            os.kill(who[1], signal.SIGKILL)
        except OSError:
            pass  # already gone, or not ours to kill: the agent's SIGKILL follows
    os._exit(HANG_EXIT)
