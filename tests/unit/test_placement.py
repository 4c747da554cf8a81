"""Hot-expert placement arithmetic (moe/placement.py) against hand-computed cases.

Shapes: P ranks, E experts, L = E/P owned per rank, R replica slots, W = L + R.
"""
import random

import pytest
import torch

from moe.placement import plan_placement, route_rows


def test_one_hot_expert_split_in_half():
    pl = plan_placement([10, 0, 0, 0], P=2, R=1)
    assert pl.replicas == ((), (0,))
    assert pl.pieces[0] == ((0, 5), (1, 5))
    assert pl.owner_rows == (10, 0) and pl.rank_rows == (5, 5)
    assert pl.slot(0, 0) == 0 and pl.slot(0, 1) == 2   # W = 3: replica after the 2 owned


def test_route_rows_canonical_chunks():
    # expert 0's 10 rows: source 0's six first, then source 1's four; owner takes 5
    routes = route_rows(plan_placement([10, 0, 0, 0], 2, 1), [[6, 0, 0, 0], [4, 0, 0, 0]])
    assert routes.runs == (((0, 5), (5, 1)), ((5, 4),))     # g = rank*3 + slot
    expect = torch.zeros(2, 2, 3, dtype=torch.long)
    expect[0, 0, 0], expect[0, 1, 2], expect[1, 1, 2] = 5, 1, 4
    assert torch.equal(routes.table_PPW, expect)


def test_world4_hot_expert_spread_to_the_mean():
    # loads [48, 8, 8, 0], mean 16: expert 0 gives 16 to rank 3, 8 to rank 1, 8 to rank 2
    pl = plan_placement([40, 8, 4, 4, 4, 4, 0, 0], P=4, R=1)
    assert pl.owner_rows == (48, 8, 8, 0)
    assert pl.pieces[0] == ((0, 8), (1, 8), (2, 8), (3, 16))
    assert pl.replicas == ((), (0,), (0,), (0,))
    assert pl.rank_rows == (16, 16, 16, 16)


def test_two_hot_ranks_one_slot_each():
    # loads [85, 0, 43, 0], mean 32: rank 0 gives 32 rows each to ranks 1 and 3, dropping to
    # 21, then takes 11 of rank 2's expert 4 in its own slot: all ranks at the mean
    pl = plan_placement([43, 42, 0, 0, 43, 0, 0, 0], P=4, R=1)
    assert pl.pieces[0] == ((0, 11), (1, 32)) and pl.pieces[1] == ((0, 10), (3, 32))
    assert pl.pieces[4] == ((2, 32), (0, 11))
    assert pl.replicas == ((4,), (0,), (), (1,))
    assert pl.rank_rows == (32, 32, 32, 32)


def test_ties_go_to_lowest_expert_and_rank():
    pl = plan_placement([5, 5, 0, 0], P=2, R=1)     # experts 0 and 1 equally hot
    assert pl.pieces[0] == ((0, 0), (1, 5)) and pl.pieces[1] == ((0, 5),)
    pl = plan_placement([0, 0, 6, 0, 0, 0], P=3, R=1)   # ranks 0 and 2 equally cold
    assert pl.pieces[2] == ((1, 2), (0, 2), (2, 2))   # owner first, replicas by rank
    assert pl.replicas == ((2,), (), (2,)) and pl.rank_rows == (2, 2, 2)


def test_odd_rows_and_no_slots():
    assert plan_placement([3, 0], 2, 1).rank_rows == (2, 1)
    pl = plan_placement([9, 7, 1, 1], P=2, R=0)
    assert pl.replicas == ((), ()) and pl.rank_rows == pl.owner_rows == (16, 2)
    routes = route_rows(pl, [[4, 3, 0, 1], [5, 4, 1, 0]])
    assert routes.runs[0] == ((0, 4), (1, 3), (3, 1))       # R=0: g is the expert id
    assert plan_placement([9, 7, 1, 1], P=2, R=2).rank_rows == (9, 9)


def test_balanced_input_gets_no_replicas():
    pl = plan_placement([4, 4, 4, 4], P=2, R=2)
    assert pl.replicas == ((), ()) and pl.rank_rows == (8, 8)


def test_random_counts_are_routed_exactly():
    rng = random.Random(0)
    for _ in range(200):
        P, L, R = rng.choice([1, 2, 4]), rng.choice([1, 2, 4]), rng.choice([0, 1, 2])
        E = P * L
        counts_PE = [[rng.choice([0, 0, 1, 3, 20]) * rng.randint(0, 3) for _ in range(E)] for _ in range(P)]
        counts_E = [sum(c[e] for c in counts_PE) for e in range(E)]
        pl = plan_placement(counts_E, P, R)
        assert all(len(r) <= R and len(set(r)) == len(r) for r in pl.replicas)
        assert all(e // L != p for p, r in enumerate(pl.replicas) for e in r)
        assert max(pl.rank_rows) <= max(pl.owner_rows) and sum(pl.rank_rows) == sum(counts_E)
        routes = route_rows(pl, counts_PE)
        W = L + R
        for s in range(P):   # each source sends exactly its rows, in expert order
            assert routes.table_PPW[s].sum() == sum(counts_PE[s])
            experts = [(g // W) * L + g % W if g % W < L else pl.replicas[g // W][g % W - L]
                       for g, _ in routes.runs[s]]
            assert experts == sorted(experts)
        assert routes.table_PPW.sum((0, 2)).tolist() == list(pl.rank_rows)


def test_bad_input():
    with pytest.raises(ValueError, match="divisible"):
        plan_placement([1, 2, 3], 2, 1)
    with pytest.raises(ValueError, match="replica_slots"):
        plan_placement([1, 2], 2, -1)


def test_plans_at_64_ranks_x_256_experts_cost_milliseconds():
    """Host arithmetic, vectorised: a layer's plan at 64 x 256 (measured 0.4 ms without
    replicas, 3-6 ms with one or two slots per rank on the 2-core machine; the Python loops
    over ranks x experts took 34-72 ms). Bounds 10x above, for a loaded machine."""
    import time

    import numpy as np
    counts = np.random.default_rng(0).integers(0, 300, (64, 256))
    for R, bound_s in ((0, 0.01), (1, 0.06), (2, 0.06)):
        t0 = time.perf_counter()
        pl = plan_placement(counts.sum(0), 64, R)
        routes = route_rows(pl, counts)
        routes.runs_of(5)
        assert time.perf_counter() - t0 < bound_s, R
        assert routes.table.sum() == counts.sum()
