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


def test_plan_refuses_unpaired_schedules_short_pipelines_and_unknown_modes():
    moe = MoEConfig(num_experts=4, top_k=2).validate()
    for schedule in ("gpipe",):
        with pytest.raises(ValueError, match=rf"parallel.pp_schedule={schedule} never runs a forward next to a backward"):
            ParallelPlan(a2a_overlap="1f1b", dp=2, pp=2, ep=2, pp_schedule=schedule,
                         microbatches=4).validate(4, moe_cfg=moe)
    for schedule in ("1f1b", "interleaved_1f1b", "zb_interleaved"):  # simulated: the pairs cost
        with pytest.raises(ValueError, match=rf"inside parallel.pp_schedule={schedule} each pair's forward "
                                             r"output leaves after the backward's interleaved pieces"):
            ParallelPlan(a2a_overlap="1f1b", pp=4, dp=2, ep=2, pp_schedule=schedule,
                         microbatches=8).validate(8, moe_cfg=moe)
    with pytest.raises(ValueError, match=r"parallel.a2a_overlap='2f2b' is not supported"):
        ParallelPlan(a2a_overlap="2f2b", dp=2, ep=2).validate(2, moe_cfg=moe)
    assert ParallelPlan(a2a_overlap="1f1b", dp=2, ep=2).validate(2, moe_cfg=moe).a2a_overlap == "1f1b"
    for schedule, m in (("zbv", 8), ("dualpipev", 8)):
        assert ParallelPlan(a2a_overlap="1f1b", pp=4, dp=2, ep=2, pp_schedule=schedule,
                            microbatches=m).validate(8, moe_cfg=moe).microbatches == m


# ---- the pairs inside a pipeline schedule (parallel/pipeline/paired_steps.py) -------------
from torch.distributed.pipelining import schedules as ts  # noqa: E402

from parallel.pipeline.paired_steps import overlapped_order, paired_counts, pairs_of, torch_order  # noqa: E402


def _leaves(actions):
    out = []
    for a in actions:
        if a is not None:
            out.extend(a.sub_actions if a.computation_type == ts.OVERLAP_F_B else (a,))
    return out


def test_last_stage_pairs_the_next_forward_with_the_previous_backward():
    _, order = torch_order("1f1b", 2, 4, 1)
    got = overlapped_order(order)
    assert [str(a) for a in got[1]] == ["1F0", "(1F1;1B0)OVERLAP_F_B", "(1F2;1B1)OVERLAP_F_B",
                                        "(1F3;1B2)OVERLAP_F_B", "1B3"]
    assert [str(a) for a in got[0]] == ["0F0", "0F1", "(0F2;0B0)OVERLAP_F_B",
                                        "(0F3;0B1)OVERLAP_F_B", "0B2", "0B3"]
    only_forward_first = overlapped_order(order, either_order=False)
    assert pairs_of(only_forward_first, 1) == 0  # F(i) B(i) never pair: same micro-batch


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_interleaved", 2),
                                         ("zbv", 2), ("dualpipev", 2)])
def test_pairing_keeps_each_rank_order_and_the_plan_rule_matches_torch_lowering(schedule, v):
    """Every action once, forwards and backwards each in their plain order, every pair of two
    micro-batches; and for the V schedules (the ones the plan takes) the plan accepts exactly
    the (pp, microbatches) whose pairing torch's lowering can schedule (either order, else
    forward first), pp 2..6, microbatches up to 3 pp."""
    moe = MoEConfig(num_experts=4, top_k=2).validate()
    for pp in range(2, 7):
        for m in range(2 * pp if schedule in ("zbv", "dualpipev") else pp, 3 * pp + 1):
            if schedule == "zb_interleaved" and m % max(1, m // pp):
                continue  # refused by plan.py for zb_interleaved on its own
            _, order = torch_order(schedule, pp, m, v)
            for either in (True, False):
                got = overlapped_order(order, either)
                for r in order:
                    plain, leaves = [a for a in order[r] if a is not None], _leaves(got[r])
                    assert sorted(map(str, leaves)) == sorted(map(str, _leaves(plain)))
                    for kind in (ts.FORWARD, ts.FULL_BACKWARD, ts.BACKWARD_INPUT):
                        assert [a for a in leaves if a.computation_type == kind] == \
                            [a for a in _leaves(plain) if a.computation_type == kind]
                    for a in got[r]:
                        if a.computation_type == ts.OVERLAP_F_B and a.stage_index == -1 and \
                                a not in order[r]:
                            f, b = a.sub_actions
                            assert f.computation_type == ts.FORWARD and f.microbatch_index != b.microbatch_index
            if schedule not in ("zbv", "dualpipev"):
                continue  # the 1F1B family's pairs are refused (their neighbour waits)
            lowered = paired_counts(schedule, pp, m, v) is not None
            try:
                ParallelPlan(a2a_overlap="1f1b", pp=pp, dp=2, ep=2, pp_schedule=schedule,
                             microbatches=m).validate(2 * pp, moe_cfg=moe)
                accepted = True
            except ValueError as e:
                assert "cannot pair forwards with backwards" in str(e), e
                accepted = False
            assert accepted == lowered, (schedule, pp, m, accepted, lowered)


class _SlowWork:
    """An exchange still on the wire: wait() blocks the host (as gloo's does) for `s`."""

    def __init__(self, s):
        self.s = s

    def wait(self):
        import time
        time.sleep(self.s)


def test_exposed_seconds_are_the_waits_not_the_compute():
    """a2a_exposed_s counts the time blocked in work.wait(), not what ran around it: 2 + 2
    waits of 30 ms, with 50 ms of compute beside each, give 4 x 30 ms (+ scheduling slack)."""
    import time
    baton = Baton()

    def forward(i):
        time.sleep(0.05)
        baton.wait(_SlowWork(0.03))
        baton.wait(_SlowWork(0.03))

    def backward(i, held):
        time.sleep(0.05)
        baton.wait(_SlowWork(0.03))
        baton.wait(_SlowWork(0.03))

    run_interleaved(2, forward, backward, baton)
    got = baton.take()
    assert got["a2a_waits"] == 8
    assert 8 * 0.03 <= got["a2a_exposed_s"] < 8 * 0.03 + 0.2, got
    assert baton.take()["a2a_exposed_s"] == 0.0  # take() starts the next step's count
