"""Expert-parallel layout validation, group rank lists (parallel.mesh.rank_groups) and the
row permutation, no processes.

P ranks, L local experts, E experts.
"""
import itertools

import pytest
import torch
import torch.distributed as dist

from models import ModelConfig, MoEConfig
from moe import MoELayer
from moe.all_to_all import all_to_all
from moe.ep_dispatcher import shard_layer_experts, source_to_expert_order
from parallel.expert import is_expert_param
from parallel.mesh import rank_groups
from parallel.plan import ParallelPlan


@pytest.mark.parametrize("world,dp,ep,E,words", [
    (4, 3, 1, None, ["parallel.dp*tp*pp", "world size is 4"]),
    (4, 4, 3, None, ["parallel.ep=3", "dp*tp = 4*1"]),
    (4, 4, 8, None, ["parallel.ep=8"]),
    (4, 4, 4, 6, ["moe.num_experts=6", "parallel.ep=4"]),
    (0, 1, 1, None, ["world_size"]),
    (4, 4, 0, None, ["parallel.ep=0"]),
    (4, 2.0, 1, None, ["parallel.dp=2.0"]),
])
def test_validation_names_the_field(world, dp, ep, E, words):
    moe = MoEConfig(num_experts=E, top_k=1) if E else None
    model = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32) if E else None
    with pytest.raises(ValueError) as info:
        ParallelPlan(dp=dp, ep=ep).validate(world, model, moe)
    for w in words:
        assert w in str(info.value)


def _plans():
    for world in (1, 2, 3, 4, 6, 8, 12, 16):
        for pp in (1, 2):
            for tp in (1, 2):
                if world % (pp * tp):
                    continue
                dp = world // (pp * tp)
                for ep in range(1, dp * tp + 1):
                    if (dp * tp) % ep == 0:
                        yield ParallelPlan(dp=dp, tp=tp, pp=pp, ep=ep).validate(world)


def test_rank_groups_partition_and_nest():
    checked = 0
    for plan in _plans():
        g = rank_groups(plan)
        sizes = {"pp": plan.pp, "dp": plan.dp, "tp": plan.tp, "ep": plan.ep, "edp": plan.edp,
                 "pool": plan.dp * plan.tp}
        for kind, size in sizes.items():
            flat = sorted(itertools.chain.from_iterable(g[kind]))
            assert flat == list(range(plan.world)), (plan, kind)  # a partition
            assert all(len(r) == size for r in g[kind]), (plan, kind)
        pool_of = {r: tuple(ranks) for ranks in g["pool"] for r in ranks}
        for e_ranks in g["ep"]:
            assert e_ranks == list(range(e_ranks[0], e_ranks[0] + plan.ep))  # neighbours
            assert set(e_ranks) <= set(pool_of[e_ranks[0]])  # inside one pipeline stage
        for e_ranks, x_ranks in itertools.product(g["ep"], g["edp"]):
            same_stage = pool_of[e_ranks[0]] == pool_of[x_ranks[0]]
            assert len(set(e_ranks) & set(x_ranks)) == int(same_stage)
        checked += 1
    assert checked > 40


def test_rank_groups_by_hand():
    g = rank_groups(ParallelPlan(dp=4, pp=2, ep=2).validate(8))  # two stages of dp=4, ep=2
    assert g["dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = rank_groups(ParallelPlan(dp=1, tp=2, ep=2).validate(2))  # experts across the tp pair
    assert g["ep"] == g["tp"] == g["pool"] == [[0, 1]] and g["dp"] == [[0], [1]]


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
