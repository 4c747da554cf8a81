"""Expert-parallel layout validation, group rank lists and the row permutation, no processes.

P ranks, L local experts, E experts.
"""
import itertools

import pytest
import torch
import torch.distributed as dist

from moe import MoELayer
from moe.ep_dispatcher import shard_layer_experts, source_to_expert_order
from parallel.all_to_all import all_to_all
from parallel.expert import expert_group_ranks, is_expert_param, validate_expert_layout


@pytest.mark.parametrize("world,dp,ep,E,words", [
    (4, 3, 1, None, ["dp=3", "world_size=4"]),
    (4, 4, 3, None, ["ep=3", "dp=4"]),
    (8, 4, 8, None, ["ep=8", "dp=4"]),
    (4, 4, 4, 6, ["num_experts=6", "ep=4"]),
    (0, 1, 1, None, ["world_size"]),
    (4, 4, 0, None, ["ep=0"]),
    (4, 2.0, 1, None, ["dp=2.0"]),
])
def test_validation_names_the_argument(world, dp, ep, E, words):
    with pytest.raises(ValueError) as info:
        validate_expert_layout(world, dp, ep, E)
    for w in words:
        assert w in str(info.value)


def _layouts():
    for world in (1, 2, 3, 4, 6, 8, 12, 16):
        for dp in range(1, world + 1):
            for ep in range(1, dp + 1):
                if world % dp == 0 and dp % ep == 0:
                    yield world, dp, ep


def test_group_ranks_partition_and_nest():
    checked = 0
    for world, dp, ep in _layouts():
        g = expert_group_ranks(world, dp, ep)
        for kind, size in (("dp", dp), ("ep", ep), ("expert_dp", dp // ep)):
            flat = sorted(itertools.chain.from_iterable(g[kind]))
            assert flat == list(range(world)), (world, dp, ep, kind)  # a partition
            assert all(len(r) == size for r in g[kind]), (world, dp, ep, kind)
        dp_of = {r: tuple(ranks) for ranks in g["dp"] for r in ranks}
        for e_ranks in g["ep"]:
            assert e_ranks == list(range(e_ranks[0], e_ranks[0] + ep))  # neighbours
            assert set(e_ranks) <= set(dp_of[e_ranks[0]])
        for e_ranks, x_ranks in itertools.product(g["ep"], g["expert_dp"]):
            same_stage = dp_of[e_ranks[0]] == dp_of[x_ranks[0]]
            assert len(set(e_ranks) & set(x_ranks)) == int(same_stage)
        checked += 1
    assert checked > 40


def test_group_ranks_by_hand():
    g = expert_group_ranks(8, 4, 2)  # two stages of dp=4, ep=2 inside each
    assert g["dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["expert_dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def _naive_order(recv_PL):
    P, L = recv_PL.shape
    starts, pos = {}, 0
    for p in range(P):
        for l in range(L):
            starts[p, l] = pos
            pos += int(recv_PL[p, l])
    return [starts[p, l] + i for l in range(L) for p in range(P) for i in range(int(recv_PL[p, l]))]


def test_source_to_expert_order_matches_loop():
    g = torch.Generator().manual_seed(0)
    tables = [torch.zeros(3, 2, dtype=torch.long), torch.tensor([[0, 5], [3, 0]]),
              torch.tensor([[4]]), torch.tensor([[0, 0, 7]])]
    tables += [torch.randint(0, 4, (P, L), generator=g) for P, L in [(2, 2), (4, 3), (8, 1), (3, 5)]]
    for t in tables:
        assert source_to_expert_order(t).tolist() == _naive_order(t), t


def test_is_expert_param_by_name():
    assert is_expert_param("blocks.0.ffn.experts.w1")
    assert is_expert_param("moe.experts.b2")
    assert not is_expert_param("blocks.0.ffn.router.weight")
    assert not is_expert_param("blocks.0.ffn.shared_experts.bank.w1")
    assert not is_expert_param("num_experts_w")
    layer = MoELayer(4, 8, 2, 1)
    names = {n for n, _ in layer.named_parameters() if is_expert_param(n)}
    assert names == {"experts.w1", "experts.w2"}


def test_shard_errors_before_any_collective():
    assert not dist.is_initialized()  # the checks below must not need a process group
    layer = MoELayer(4, 8, 4, 1)
    with pytest.raises(ValueError, match="ep_group is None"):
        shard_layer_experts(layer, None)
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard_layer_experts(layer, object())
    assert layer.experts.w1.shape[0] == 4 and layer.ep_group is None


def test_all_to_all_split_mismatch():
    with pytest.raises(ValueError, match="in_splits"):
        all_to_all(torch.zeros(3, 2), [1, 1], [1, 1])
