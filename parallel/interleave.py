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

Memory: two micro-batches' activations are alive at once (the forward of i+1 while i's are
held for its backward).
"""
import threading
import time

__all__ = ["Baton", "run_interleaved"]


class Baton:
    """Who runs now, the forward ("F") or the backward ("B"); `wait(work)` is the MoE
    layers' a2a waiter. `exposed_s` / `waits`: seconds blocked in work.wait() and the number
    of waits since the last take() (for the benchmark and the metrics)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.turn, self.active, self.forward_thread = None, set(), None
        self.exposed_s, self.waits, self.handed = 0.0, 0, 0

    def _role(self) -> str:
        return "F" if threading.get_ident() == self.forward_thread else "B"

    def wait(self, work) -> None:
        """Let the other micro-batch run until it reaches an exchange of its own (or ends),
        then wait for `work`."""
        me = self._role()
        other = "B" if me == "F" else "F"
        with self.cond:
            if other in self.active and self.turn == me:
                self.turn, self.handed = other, self.handed + 1
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.turn == me)
        t0 = time.perf_counter()
        work.wait()
        self.exposed_s += time.perf_counter() - t0
        self.waits += 1

    def _done(self, role: str) -> None:
        with self.cond:
            self.active.discard(role)
            self.turn = "B" if role == "F" else "F"
            self.cond.notify_all()

    def pair(self, forward, backward) -> None:
        """Run forward() and backward() interleaved (forward first); both always finish, and
        the first error of either is raised after both have."""
        errors = []
        with self.cond:
            self.active, self.turn = {"F", "B"}, "F"

        def run_forward():
            self.forward_thread = threading.get_ident()
            try:
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
        if errors:
            raise errors[0]

    def take(self) -> dict:
        out = {"a2a_exposed_s": self.exposed_s, "a2a_waits": self.waits, "a2a_handed": self.handed}
        self.exposed_s, self.waits, self.handed = 0.0, 0, 0
        return out


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
