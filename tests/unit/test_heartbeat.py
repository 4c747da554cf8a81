"""Hang detection (trainer/heartbeat.py) on an in-process store, three ranks as three
heartbeats, the reaction recorded instead of exiting.

- Beats come from a side thread, so a main thread busy for 3 x the timeout (sleeping, in a
  pure-Python loop that holds the GIL between switches, in torch kernels) trips nothing: what a
  slow checkpoint save, evaluation or first-step compile looks like to the detector.
- A rank whose beats stop (its thread halted: a SIGSTOPped process) is named, with its host and
  pid, within the timeout plus one beat interval by the rank watching it; the other live rank
  reads the same line from the store and reacts too.
"""
import os
import socket
import time

import torch
import torch.distributed as dist

from trainer.heartbeat import HANG_EXIT, Heartbeat, silent_rank

TIMEOUT = 0.6


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
    beats[1].stop()                      # rank 1 frozen: its counter no longer moves
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
