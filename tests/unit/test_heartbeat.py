"""Hang detection (trainer/heartbeat.py) on an in-process store, three ranks as three
heartbeats, the reaction recorded instead of exiting.

- Beats come from a side thread, so a main thread busy for 3 x the timeout (sleeping, in a
  pure-Python loop that holds the GIL between switches, in torch kernels) trips nothing: what a
  slow checkpoint save, evaluation or first-step compile looks like to the detector.
- A rank whose beats stop (its thread halted: a SIGSTOPped process) is named, with its host and
  pid, within the timeout plus one beat interval by the rank watching it; the other live rank
  reads the same line from the store and reacts too; the process it would kill is the one
  named (pid, namespace and start time), never the reader's own watched rank.
- A rank that finished (stop(): marked done) is never reported, however long its peers take.
- Store errors are said and retried; after STORE_RETRIES in a row detection says it is off.
- may_kill: only this host's process with the posted namespace and start time.
"""
import os
import socket
import time

import torch
import torch.distributed as dist

from trainer.heartbeat import HANG_EXIT, STORE_RETRIES, Heartbeat, identity, may_kill, silent_rank

TIMEOUT = 0.6


def _freeze(beat):
    """What SIGSTOP does to a rank's heartbeat: the thread halts, nothing is marked done."""
    beat._stop.set()
    beat._thread.join()


def _ranks(store, world, seen):
    return [Heartbeat(store, r, world, TIMEOUT, act=lambda line, r=r: seen.append((r, line))).start()
            for r in range(world)]


def test_a_busy_main_thread_trips_nothing():
    seen = []
    beats = _ranks(dist.HashStore(), 3, seen)
    try:
        time.sleep(3 * TIMEOUT)
        end = time.monotonic() + 3 * TIMEOUT
        n = 0
        while time.monotonic() < end:   # pure Python, GIL held between the interpreter's switches
            n += 1
        a = torch.randn(256, 256)
        end = time.monotonic() + 3 * TIMEOUT
        while time.monotonic() < end:   # torch kernels
            a = (a @ a).tanh()
    finally:
        for b in beats:
            b.stop()
    assert seen == []


def test_a_stopped_rank_is_named_by_its_watcher_and_every_live_rank_reacts():
    seen = []
    beats = _ranks(dist.HashStore(), 3, seen)
    _freeze(beats[1])                    # rank 1 frozen: its counter no longer moves
    t0 = time.monotonic()
    while len(seen) < 2 and time.monotonic() - t0 < 10 * TIMEOUT:
        time.sleep(0.02)
    took = time.monotonic() - t0
    for b in beats:
        b.stop()
    assert sorted(r for r, _ in seen) == [0, 2]          # rank 0 watches 1; rank 2 reads the post
    lines = {line for _, line in seen}
    assert len(lines) == 1
    line = lines.pop()
    assert line.startswith("hang: rank 1 ") and f"exit {HANG_EXIT}" in line
    assert silent_rank(line) == (socket.gethostname(), os.getpid())
    assert took <= TIMEOUT + 2 * beats[0].interval + 0.5, took


def test_silent_rank_of_other_lines():
    assert silent_rank("error on rank 1: boom") is None
    assert silent_rank("hang: rank 7 (host n12, pid 4242) has not answered") == ("n12", 4242)


def test_the_rank_to_kill_is_the_one_named():
    seen = []
    beats = _ranks(dist.HashStore(), 3, seen)
    _freeze(beats[1])
    t0 = time.monotonic()
    while len(seen) < 2 and time.monotonic() - t0 < 10 * TIMEOUT:
        time.sleep(0.02)
    for b in beats:
        b.stop()
    # rank 2 watches rank 0, but the post names rank 1: both would kill rank 1's process
    assert beats[0].hung_rank == beats[2].hung_rank == 1
    host, pid, ident = beats[2].silent_who()
    assert (host, pid) == (socket.gethostname(), os.getpid()) and ident == identity(os.getpid())


def test_a_finished_rank_is_never_reported():
    seen = []
    beats = _ranks(dist.HashStore(), 3, seen)
    beats[1].stop()                      # finished (the teardown barrier passed), marked done
    time.sleep(4 * TIMEOUT)
    for b in beats:
        b.stop()
    assert seen == []


class _FailingStore:
    """A store whose calls fail after `ok` of them (a rendezvous host that went away)."""

    def __init__(self, ok):
        self.inner, self.ok = dist.HashStore(), ok

    def __getattr__(self, name):
        def call(*a, **k):
            self.ok -= 1
            if self.ok < 0:
                raise RuntimeError("Connection reset by peer")
            return getattr(self.inner, name)(*a, **k)
        return call


def test_store_errors_are_said_retried_then_detection_says_it_is_off(capsys):
    beat = Heartbeat(_FailingStore(ok=4), 0, 2, TIMEOUT, act=lambda line: None).start()
    beat._thread.join(timeout=(STORE_RETRIES + 3) * beat.interval + 2)
    assert not beat._thread.is_alive()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == STORE_RETRIES, err
    assert all("hang detection could not reach the rendezvous store (RuntimeError: Connection "
               "reset by peer)" in line for line in err), err
    assert err[0].endswith("retrying") and "hang detection is OFF for the rest of this run" in err[-1]


def test_may_kill_only_the_same_process_on_this_host():
    me = os.getpid()
    assert identity(me) is not None
    assert not may_kill(None)
    assert not may_kill((socket.gethostname(), me, identity(me)))        # never itself
    parent = os.getppid()
    assert may_kill((socket.gethostname(), parent, identity(parent)))
    assert not may_kill((socket.gethostname(), parent, "1:2"))           # another namespace/start
    assert not may_kill(("another-host", parent, identity(parent)))
    assert not may_kill((socket.gethostname(), parent, "-"))             # identity unknown
