"""parallel/interleave.py without process groups: the order in which the forward of one
micro-batch and the backward of another run (the baton moves only at waits), errors, and
the plan's refusals of parallel.a2a_overlap."""
import pytest

from models.config import MoEConfig
from parallel.interleave import Baton, run_interleaved
from parallel.plan import ParallelPlan


class _Work:
    """A finished exchange: wait() returns at once and is logged."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(f"{self.name} done")


def _micro_batches(n, exchanges=2):
    log, baton = [], Baton()

    def forward(i):
        for x in range(exchanges):
            log.append(f"F{i} compute {x}")
            baton.wait(_Work(log, f"F{i} a2a {x}"))
        log.append(f"F{i} end")
        return i

    def backward(i, held):
        assert held == i
        for x in range(exchanges):
            log.append(f"B{i} compute {x}")
            baton.wait(_Work(log, f"B{i} a2a {x}"))
        log.append(f"B{i} end")

    run_interleaved(n, forward, backward, baton, lambda: log.append("last"))
    return log, baton


def test_forward_and_backward_alternate_at_every_exchange():
    log, baton = _micro_batches(2)
    assert log == [
        "F0 compute 0", "F0 a2a 0 done", "F0 compute 1", "F0 a2a 1 done", "F0 end",  # alone
        "F1 compute 0",                    # F1 issues, hands over
        "B0 compute 0",                    # B0 computes while F1's rows fly, issues, hands over
        "F1 a2a 0 done", "F1 compute 1",   # F1 takes its rows, computes, hands over again
        "B0 a2a 0 done", "B0 compute 1",
        "F1 a2a 1 done", "F1 end",         # F1 ends: B0 runs on alone
        "B0 a2a 1 done", "B0 end",
        "last", "B1 compute 0", "B1 a2a 0 done", "B1 compute 1", "B1 a2a 1 done", "B1 end"]
    stats = baton.take()
    assert stats["a2a_waits"] == 8 and stats["a2a_handed"] == 4
    assert baton.take()["a2a_waits"] == 0  # take() resets


def test_backwards_keep_their_order_and_every_forward_runs_once():
    log, _ = _micro_batches(4, exchanges=3)
    ends = [e for e in log if e.endswith(" end")]
    assert [e for e in ends if e.startswith("B")] == ["B0 end", "B1 end", "B2 end", "B3 end"]
    assert [e for e in ends if e.startswith("F")] == ["F0 end", "F1 end", "F2 end", "F3 end"]
    # F(i+1) ends before B(i) does: the forward never waits for the whole backward
    for i in range(3):
        assert log.index(f"F{i + 1} end") < log.index(f"B{i} end")


def test_an_error_in_either_is_raised_after_both_finished():
    baton, log = Baton(), []

    def forward(i):
        if i == 1:
            baton.wait(_Work(log, "F1 a2a"))
            raise RuntimeError("forward 1 failed")
        return i

    def backward(i, held):
        baton.wait(_Work(log, f"B{i} a2a"))
        log.append(f"B{i} end")

    with pytest.raises(RuntimeError, match="forward 1 failed"):
        run_interleaved(3, forward, backward, baton)
    assert "B0 end" in log and "B1 end" not in log  # B0 finished; nothing ran after the error


@pytest.mark.parametrize("plan_kw, moe_kw, match", [
    (dict(dp=2), {}, r"parallel.a2a_overlap=1f1b: parallel.ep=1 has no expert all-to-all to hide"),
    (dict(dp=1, pp=2, ep=1), {}, r"parallel.ep=1"),
    (dict(dp=2, ep=2), dict(a2a_overlap_degree=2), r"moe.a2a_overlap_degree > 1 waits for its own chunks"),
])
def test_plan_refusals(plan_kw, moe_kw, match):
    moe = MoEConfig(num_experts=4, top_k=2, **moe_kw).validate()
    with pytest.raises(ValueError, match=match):
        ParallelPlan(a2a_overlap="1f1b", **plan_kw).validate(2, moe_cfg=moe)


def test_plan_refuses_pipelines_and_unknown_modes():
    moe = MoEConfig(num_experts=4, top_k=2).validate()
    with pytest.raises(ValueError, match=r"under parallel.pp=2 the pipeline schedule runs the micro-batches"):
        ParallelPlan(a2a_overlap="1f1b", dp=2, pp=2, ep=2).validate(4, moe_cfg=moe)
    with pytest.raises(ValueError, match=r"parallel.a2a_overlap='2f2b' is not supported"):
        ParallelPlan(a2a_overlap="2f2b", dp=2, ep=2).validate(2, moe_cfg=moe)
    assert ParallelPlan(a2a_overlap="1f1b", dp=2, ep=2).validate(2, moe_cfg=moe).a2a_overlap == "1f1b"
