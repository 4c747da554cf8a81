"""moe/profiling/timeline.py: overlap and exposure read from hand-placed timestamps."""
import json

import pytest

from moe.profiling.timeline import Timeline


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _timeline():
    clock = Clock()
    tl = Timeline(clock)
    tl.issued("dispatch 0")            # t=0
    clock.t = 1.0
    tl.issued("dispatch 1")            # t=1
    with tl.span("wait", "dispatch 0"):
        clock.t = 2.0                  # blocked 1..2
    with tl.span("compute", "experts 0"):
        clock.t = 5.0                  # computes 2..5 while dispatch 1 flies
    with tl.span("wait", "dispatch 1"):
        clock.t = 5.5                  # blocked 5..5.5
    with tl.span("compute", "experts 1"):
        clock.t = 8.0
    return tl


def test_in_flight_and_exposed_fraction():
    tl = _timeline()
    assert tl.in_flight_during("dispatch 1", "experts 0")
    assert not tl.in_flight_during("dispatch 0", "experts 0")   # waited before it started
    assert tl.blocked_seconds() == pytest.approx(1.5)
    assert tl.exposed_fraction(8.0) == pytest.approx(1.5 / 8.0)
    with pytest.raises(KeyError, match="no issue event named 'combine 0'"):
        tl.in_flight_during("combine 0", "experts 1")


def test_chrome_trace(tmp_path):
    tl = _timeline()
    path = tmp_path / "t.json"
    tl.save_chrome_trace(str(path), rank=3)
    events = json.loads(path.read_text())["traceEvents"]
    assert len(events) == len(tl.events) and {e["pid"] for e in events} == {3}
    issue = [e for e in events if e["ph"] == "i"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert len(issue) == 2 and spans["experts 0"]["ts"] == pytest.approx(2e6)
    assert spans["experts 0"]["dur"] == pytest.approx(3e6)
