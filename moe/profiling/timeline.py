"""A per-rank timeline of the expert-parallel exchange: when each all-to-all is issued and
waited on, and when each chunk of experts computes (moe/chunked_a2a.py writes it).

Events are (kind, name, t0, t1) in seconds of this process's perf_counter:
  issue    an asynchronous all-to-all handed to the backend (t0 == t1)
  wait     the host blocked until that all-to-all finished (the exposed communication)
  compute  a chunk of expert rows (or the shared experts) computing
Names say the phase, the chunk and the direction: "dispatch 1", "combine 0 bwd", ...

What it proves: chunk c+1's exchange is in flight (issued, not yet waited) while chunk c
computes (`in_flight_during`), and how much of a step the host spent blocked in waits
(`exposed_fraction`). On CPU/gloo the backend moves bytes on its own threads; on CUDA the
"wait" is the host enqueueing a stream dependency, so the GPU view of exposure needs the
CUDA profiler -- the timestamps here are the issue order, which is what overlap needs.
"""
import contextlib
import json
import time


class Timeline:
    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.events = []   # (kind, name, t0, t1)

    def issued(self, name: str) -> None:
        t = self.clock()
        self.events.append(("issue", name, t, t))

    @contextlib.contextmanager
    def span(self, kind: str, name: str):
        t0 = self.clock()
        try:
            yield
        finally:
            self.events.append((kind, name, t0, self.clock()))

    def clear(self) -> None:
        self.events.clear()

    def find(self, kind: str, name: str):
        """The first event of this kind and name (a KeyError names what is missing)."""
        for e in self.events:
            if e[0] == kind and e[1] == name:
                return e
        raise KeyError(f"no {kind} event named {name!r} on the timeline")

    def in_flight_during(self, exchange: str, compute: str) -> bool:
        """True when `exchange` was issued before `compute` started and waited on only after
        it ended: the exchange had the whole compute span to make progress."""
        issued, waited = self.find("issue", exchange), self.find("wait", exchange)
        start, end = self.find("compute", compute)[2:]
        return issued[2] <= start and waited[2] >= end

    def blocked_seconds(self) -> float:
        return sum(t1 - t0 for kind, _, t0, t1 in self.events if kind == "wait")

    def exposed_fraction(self, step_seconds: float) -> float:
        """Time blocked in all-to-all waits / the step's wall time."""
        return self.blocked_seconds() / step_seconds if step_seconds > 0 else 0.0

    def chrome_trace(self, rank: int) -> list:
        """Events in the Chrome/Perfetto trace format (one process per rank, microseconds)."""
        out = []
        t_ref = min((e[2] for e in self.events), default=0.0)
        for kind, name, t0, t1 in self.events:
            ev = {"name": name, "cat": kind, "pid": rank, "tid": kind,
                  "ts": (t0 - t_ref) * 1e6}
            if kind == "issue":
                ev.update(ph="i", s="t")
            else:
                ev.update(ph="X", dur=(t1 - t0) * 1e6)
            out.append(ev)
        return out

    def save_chrome_trace(self, path: str, rank: int) -> None:
        with open(path, "w") as f:
            json.dump({"traceEvents": self.chrome_trace(rank)}, f)

