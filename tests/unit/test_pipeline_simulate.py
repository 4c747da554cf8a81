"""parallel/pipeline/simulate.py, the schedule simulation the planner prices the overlap's
pipeline pairs with: against closed forms and hand-computed pairs, the fault it shows (pairs
sending only when both halves end make neighbouring stages take turns: 1.4-1.5x the plain
step with nothing to hide) and its absence now (each half sends as it ends: 1.0x)."""
import pytest

from parallel.pipeline.simulate import StepCost, _pair, simulate


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 4), (4, 8), (4, 4)])
def test_plain_1f1b_is_the_closed_form(pp, m):
    """1F1B with uniform stages: (m + p - 1) (f + b), exchanges waited for inside each."""
    assert simulate("1f1b", pp, m, 1, StepCost(f=1.0, b=2.0)) == (m + pp - 1) * 3.0
    got = simulate("1f1b", pp, m, 1, StepCost(f=1.0, b=2.0, a_f=0.5, a_b=0.25))
    assert got == pytest.approx((m + pp - 1) * 3.75)


def test_a_pair_by_hand():
    """Forward 2 of compute and 2 of exchanges, backward 4 and 2, two pieces each, both
    inputs there at 0: F1 [0,1] (its exchange till 2), B1 [1,3] (till 4), F2 [3,4] (F ends
    at 5), B2 [4,6] (ends at 7); one after the other they take 4 + 6 = 10."""
    assert _pair(0.0, 0.0, 2.0, 2.0, 4.0, 2.0, 2) == (5.0, 7.0)
    # the backward's input comes at 3: it takes the turn after F1 and waits for it there
    # (B1 [3,5], F2 [5,6]: F ends at 7, B2 [6,8]: B at 9)
    assert _pair(0.0, 3.0, 2.0, 2.0, 4.0, 2.0, 2) == (7.0, 9.0)


@pytest.mark.parametrize("schedule, pp, m, v", [("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1),
                                                ("interleaved_1f1b", 4, 8, 2)])
def test_pairs_no_longer_make_neighbours_take_turns(schedule, pp, m, v):
    plain = simulate(schedule, pp, m, v, StepCost())
    now = simulate(schedule, pp, m, v, StepCost(paired=True))
    before = simulate(schedule, pp, m, v, StepCost(paired=True, send="pair"))
    assert now == plain
    assert 1.35 <= before / plain <= 1.6, before / plain


def test_pairs_gain_only_when_the_exchange_is_large_enough():
    """A pair's forward ends after the backward's interleaved pieces, which the next stage
    waits for: with the exchanges a third of the compute the pairs cost (1.09x); as large as
    the compute they gain (0.97x; 1F1B, 4 stages, 8 micro-batches, 4 exchanges a chunk)."""
    def ratio(a):
        cost = StepCost(a_f=a, a_b=a)
        plain = simulate("1f1b", 4, 8, 1, cost)
        return simulate("1f1b", 4, 8, 1, StepCost(a_f=a, a_b=a, paired=True)) / plain
    assert ratio(0.5) == pytest.approx(1.088, abs=1e-3)
    assert ratio(1.0) == pytest.approx(0.973, abs=1e-3)
