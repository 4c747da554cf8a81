"""Expert capacity: the formula, and exactly which assignments are dropped.

Shapes: G routing groups, S tokens per group, K top-k, E experts.
Precedence inside a group: all first choices (token order) before any second choice.
"""
import math

import pytest
import torch

from moe.capacity import capacity_keep_mask, expert_capacity


def naive_keep(ids_GSK, E, cap):
    G, S, K = ids_GSK.shape
    keep = torch.zeros(G, S, K, dtype=torch.bool)
    for g in range(G):
        used = [0] * E
        for k in range(K):
            for s in range(S):
                e = int(ids_GSK[g, s, k])
                if used[e] < cap:
                    used[e] += 1
                    keep[g, s, k] = True
    return keep


@pytest.mark.parametrize("cf,S,K,E,want", [
    (1.0, 8, 2, 4, 4), (1.25, 8, 2, 4, 5), (0.1, 8, 1, 4, 1), (2.0, 7, 1, 3, 5), (1.0, 1, 1, 64, 1),
])
def test_capacity_formula(cf, S, K, E, want):
    assert expert_capacity(cf, S, K, E) == want == max(1, math.ceil(cf * S * K / E))


def test_hand_example_first_choices_win_then_earlier_tokens():
    # one group, 4 tokens, k=2, capacity 2 per expert.
    ids = torch.tensor([[[0, 1], [0, 1], [1, 0], [0, 2]]])
    keep = capacity_keep_mask(ids, num_experts=3, capacity=2)
    # expert 0: first choices of tokens 0,1,3 -> tokens 0 and 1 fit, token 3 is dropped;
    #           second choice of token 2 comes after all first choices -> dropped.
    # expert 1: first choice of token 2, then second choices of tokens 0, 1 -> token 1 dropped.
    # expert 2: second choice of token 3 -> kept.
    want = torch.tensor([[[True, True], [True, False], [True, False], [False, True]]])
    assert torch.equal(keep, want)


def test_capacity_is_per_group():
    ids = torch.zeros(3, 5, 1, dtype=torch.long)  # every token of every group -> expert 0
    keep = capacity_keep_mask(ids, num_experts=2, capacity=2)
    want = torch.tensor([True, True, False, False, False]).view(1, 5, 1).expand(3, 5, 1)
    assert torch.equal(keep, want)


@pytest.mark.parametrize("K,cap", [(1, 1), (2, 3), (4, 2), (3, 100)])
def test_matches_naive_loop_on_random_routing(K, cap):
    g = torch.Generator().manual_seed(K * 31 + cap)
    G, S, E = 3, 17, 6
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(G * S)]).view(G, S, K)
    keep = capacity_keep_mask(ids, E, cap)
    assert torch.equal(keep, naive_keep(ids, E, cap))
    counts = torch.zeros(G, E, dtype=torch.long)
    counts.scatter_add_(1, ids.view(G, -1), keep.view(G, -1).long())
    assert int(counts.max()) <= cap
