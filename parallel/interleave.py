"""The forward of one micro-batch beside the backward of another (parallel.a2a_overlap=1f1b).

With m >= 2 micro-batches per step (gradient accumulation) a rank runs
    F0, (F1 | B0), (F2 | B1), ..., (F{m-1} | B{m-2}), B{m-1}
where (Fi+1 | Bi) runs the two as interleaved pieces: Fi+1 on a helper thread, Bi on the
caller's, one at a time (a baton), switching at every expert all-to-all. Each MoE layer's
exchanges (dispatch, combine and their backward, moe/all_to_all.py) are issued
asynchronously and waited for through `Baton.wait`: it hands the baton to the other
micro-batch, which computes (attention, experts, ...) while the rows are on the wire, and
takes it back when the other reaches its own exchange or ends. Only the first forward and
the last backward have nothing to hide behind.

Why it is exact: each micro-batch runs the same operations in the same order as it would
alone; the forward never reads what the backward writes (parameter gradients), and the
backwards still run in micro-batch order (B0 before B1 ...), so gradients accumulate in the
same order. Why ranks agree: the baton moves only at exchange points, which every rank of
the ep group reaches in the same order (the same model, the same schedule), so collectives
are issued in the same order everywhere. On CUDA the backward's pieces run on autograd's
device thread: every thread that is not the forward's counts as the backward.

Random numbers: the two micro-batches share the process's generators (CPU, and CUDA's), so
each keeps its own state, swapped in at every hand-over: the forward draws dropout masks and
router jitter from the state the plain loop would have (its predecessor's forward ends where it
starts), and a backward that recomputes (activation checkpointing restores the forward's saved
state) keeps drawing from its own, whatever the other ran in between. After the pair, the
forward's state goes on, as after a plain forward.

The helper thread runs in the caller's context: its CUDA device and stream, and the dispatch
modes active on the caller's thread (the communication ledger, the memory counter, strict
collectives), so what the forward does there is seen as if it ran on the caller's.

Memory: the forward of i+1 runs while i's activations are held for its backward, but the
baton hands over at every expert all-to-all, so the backward frees a block for each block
the forward builds: i+1 is ahead by the blocks up to its first MoE one (measured, dp2 x ep2,
6 MoE blocks: +0.2 of a micro-batch's activations, not +1; parallel/planner/memory.py).
"""
import contextlib
import functools
import threading
import time

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["Baton", "run_interleaved"]


class Baton:
    """Who runs now, the forward ("F") or the backward ("B"); `wait(work)` is the MoE
    layers' a2a waiter. take() gives a2a_exposed_s, the seconds the exchanges were waited for
    after the other micro-batch ran (gloo: the host blocked in work.wait(); CUDA: the stream
    stalled between events recorded around it, as NCCL's wait blocks the stream, not the
    host), and the numbers of waits and hand-overs since the last take()."""

    def __init__(self):
        self.cond = threading.Condition()
        self.turn, self.active, self.forward_thread = None, set(), None
        self.exposed_s, self.waits, self.handed = 0.0, 0, 0
        self.stalls = []  # CUDA: (start, end) events around each wait, read in take()
        self.rng = {}   # role -> its generator states while the other runs

    def _hand_rng(self, me: str, other: str) -> None:
        """Keep my generator states, put the other's back (called with the baton held)."""
        self.rng[me] = _rng_state()
        if other in self.rng:
            _set_rng_state(self.rng.pop(other))

    def _role(self) -> str:
        return "F" if threading.get_ident() == self.forward_thread else "B"

    def wait(self, work, count: bool = True) -> None:
        """Let the other micro-batch run until it reaches an exchange of its own (or ends),
        then wait for `work`. count=False: not an expert exchange (a pipeline receive), left
        out of the figures take() gives."""
        me = self._role()
        other = "B" if me == "F" else "F"
        with self.cond:
            if other in self.active and self.turn == me:
                self._hand_rng(me, other)
                self.turn, self.handed = other, self.handed + count
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.turn == me)
        if not count:
            work.wait()
            return
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # NCCL's wait only makes the stream wait: time the stream's stall, not the host's
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work.wait()
            end.record()
            self.stalls.append((start, end))
        else:  # gloo's wait blocks the host until the rows are here
            t0 = time.perf_counter()
            work.wait()
            self.exposed_s += time.perf_counter() - t0
        self.waits += 1

    def _done(self, role: str) -> None:
        with self.cond:
            other = "B" if role == "F" else "F"
            self.active.discard(role)
            if other in self.active:
                self._hand_rng(role, other)
            else:
                self.rng[role] = _rng_state()
            self.turn = other
            self.cond.notify_all()

    def pair(self, forward, backward) -> None:
        """Run forward() and backward() interleaved (forward first); both always finish, and
        the first error of either is raised after both have."""
        errors = []
        with self.cond:
            self.active, self.turn, self.rng = {"F", "B"}, "F", {}
        context = _thread_context()

        def run_forward():
            self.forward_thread = threading.get_ident()
            try:
                with context():
                    forward()
            except BaseException as e:  # re-raised on the caller's thread
                errors.append(e)
            finally:
                self._done("F")

        thread = threading.Thread(target=run_forward, name="moekit-1f1b-forward", daemon=True)
        thread.start()
        with self.cond:
            self.cond.wait_for(lambda: self.turn == "B")
        try:
            backward()
        except BaseException as e:
            errors.append(e)
        finally:
            self._done("B")
        thread.join()
        self.forward_thread = None
        if "F" in self.rng:  # the stream goes on from the forward's, as after a plain forward
            _set_rng_state(self.rng.pop("F"))
        self.rng = {}
        if errors:
            raise errors[0]

    def take(self, wait: bool = True) -> dict:
        """The step's figures (and reset). On CUDA the exposed seconds are read from events:
        wait=True waits for the step's last exchange to give them; wait=False leaves them on
        the device, a2a_exposed_s then a function that reads them later (train.step_checks=
        device reads it with the step's other held values)."""
        host_s, stalls = self.exposed_s, self.stalls
        out = {"a2a_waits": self.waits, "a2a_handed": self.handed}
        self.exposed_s, self.waits, self.handed, self.stalls = 0.0, 0, 0, []
        out["a2a_exposed_s"] = _exposed(host_s, stalls) if wait else functools.partial(_exposed, host_s, stalls)
        return out


def _exposed(host_s: float, stalls: list) -> float:
    """Seconds waited: the host's (gloo) plus the stream's stalls between (start, end) events."""
    if stalls:
        stalls[-1][1].synchronize()
    return host_s + sum(a.elapsed_time(b) for a, b in stalls) / 1e3


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _thread_context():
    """-> a context manager that puts the calling thread's CUDA device and stream and its
    dispatch modes on the thread that enters it."""
    modes = list(_get_current_dispatch_mode_stack())
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device = torch.cuda.current_device() if cuda else None
    stream = torch.cuda.current_stream() if cuda else None

    @contextlib.contextmanager
    def enter():
        with contextlib.ExitStack() as stack:
            if device is not None:
                torch.cuda.set_device(device)
                stack.enter_context(torch.cuda.stream(stream))
            for mode in modes:
                stack.enter_context(mode)
            yield
    return enter


def run_interleaved(n: int, forward, backward, baton: Baton, before_last=None) -> None:
    """forward(i) -> what backward(i, it) needs; runs F0, (F1 | B0), ..., B{n-1}.
    before_last(): called just before the last backward, which runs alone (e.g. turn on the
    gradient reduction that rides on it)."""
    held = {0: forward(0)}
    for i in range(n - 1):
        def fwd(i=i):
            held[i + 1] = forward(i + 1)
        baton.pair(fwd, lambda i=i: backward(i, held.pop(i)))
    if before_last is not None:
        before_last()
    backward(n - 1, held.pop(n - 1))
