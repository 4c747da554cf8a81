"""Ways a run stops early on purpose, each with its exit code and one line for the user.

Every rank raises the same one at the same step (the decision is all-reduced), so there is
no peer left waiting in a collective. train.py prints the line (rank 0), records it for
torchrun's summary and exits with `exit_code`.
"""
import signal
import sys


class Stopped(Exception):
    exit_code = 1
    label = "error"  # the line starts "<label>: "


class Diverged(Stopped):
    """train.max_skipped_steps consecutive steps had a non-finite loss or gradient norm."""
    exit_code = 3


class Preempted(Stopped):
    """SIGTERM: the step was finished and a checkpoint saved. 143 = 128 + SIGTERM, what a
    scheduler expects from a terminated job (not a success, not a crash)."""
    exit_code = 143
    label = "preempted"


class StopRequest:
    """Set by SIGTERM while installed; read once per step (then agreed over all ranks).
    A second SIGTERM falls back to the previous handler (by default: die at once)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        except ValueError:  # not the main thread (e.g. a test harness): no preemption support
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        return False

    def _on_signal(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
        print("SIGTERM received: finishing this step and saving a checkpoint (a second SIGTERM "
              "stops at once)", file=sys.stderr, flush=True)
