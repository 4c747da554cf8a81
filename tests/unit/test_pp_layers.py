"""parallel.pp_layers: blocks per pipeline stage (even, explicit, auto) -- the cost model's
parameter counts against the built model, the balancer against brute force, the refusals,
and the split a pipeline rank really gets (block ids read from a meta parallelize)."""
import itertools

import pytest

from models import build_model
from models.config import ModelConfig, MoEConfig
from parallel.pipeline.layers import balanced, block_weights, stage_blocks
from parallel.plan import ParallelPlan


def _cfgs(n_layers=5, **moe):
    m = ModelConfig(vocab_size=64, d_model=32, n_layers=n_layers, n_heads=4, d_ff=64,
                    tie_embeddings=False, activation="swiglu")
    return m, MoEConfig(**{"num_experts": 4, "top_k": 2, "every": 2, **moe})


@pytest.mark.parametrize("moe", [{}, {"num_shared_experts": 1, "d_ff": 48}, {"first_moe_layer": 3, "every": 1}])
def test_block_parameters_equal_the_built_model(moe):
    m, e = _cfgs(**moe)
    model = build_model(m, e, device="meta")
    _, params, embed, (_, head) = block_weights(m, e, 16)
    for i, block in enumerate(model.blocks):
        matrices = sum(p.numel() for p in block.parameters() if p.dim() >= 2)
        assert params[i] == matrices, (i, params[i], matrices)
    assert embed == model.tok_emb.weight.numel() and head == model.lm_head.weight.numel()


def _brute(times, params, k, first, last):
    n, best = len(times), None
    t_mean = (sum(times) + first[0] + last[0]) / k
    p_mean = (sum(params) + first[1] + last[1]) / k
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        worst = 0.0
        for s in range(k):
            a, b = bounds[s], bounds[s + 1]
            t, p = sum(times[a:b]), sum(params[a:b])
            if s == 0:
                t, p = t + first[0], p + first[1]
            if s == k - 1:
                t, p = t + last[0], p + last[1]
            worst = max(worst, t / t_mean, p / p_mean)
        if best is None or worst < best - 1e-12:
            best = worst
    return best


def _worst(counts, times, params, first, last):
    k, out, a = len(counts), 0.0, 0
    t_mean = (sum(times) + first[0] + last[0]) / k
    p_mean = (sum(params) + first[1] + last[1]) / k
    for s, c in enumerate(counts):
        t, p = sum(times[a:a + c]), sum(params[a:a + c])
        if s == 0:
            t, p = t + first[0], p + first[1]
        if s == k - 1:
            t, p = t + last[0], p + last[1]
        out, a = max(out, t / t_mean, p / p_mean), a + c
    return out


@pytest.mark.parametrize("seed", range(6))
def test_balancer_is_optimal_against_brute_force(seed):
    import random
    rng = random.Random(seed)
    n, k = rng.randint(4, 9), rng.randint(2, 4)
    times = [rng.choice([1.0, 3.0, 3.5]) for _ in range(n)]
    params = [rng.choice([1.0, 8.0]) for _ in range(n)]
    first, last = (0.0, rng.random() * 4), (rng.random() * 3, rng.random() * 2)
    counts = balanced(times, params, k, first, last)
    assert len(counts) == k and sum(counts) == n and min(counts) >= 1
    assert abs(_worst(counts, times, params, first, last) - _brute(times, params, k, first, last)) < 1e-9


def test_validate_resolves_the_three_forms():
    m, e = _cfgs(n_layers=6)
    even = ParallelPlan(pp=2, microbatches=2).validate(2, m, e, 8, 16)
    assert even.pp_layers == "3,3"
    explicit = ParallelPlan(pp=2, microbatches=2, pp_layers="2,4").validate(2, m, e, 8, 16)
    assert stage_blocks(explicit.pp_layers, 6, 2) == [[0, 1], [2, 3, 4, 5]]
    auto = ParallelPlan(pp=2, microbatches=2, pp_layers="auto").validate(2, m, e, 8, 16)
    counts = [int(c) for c in auto.pp_layers.split(",")]
    assert sum(counts) == 6 and len(counts) == 2
    # DeepSeek-V3's shape: 61 layers, the first 3 dense, over 16 stages
    m61 = ModelConfig(vocab_size=1024, d_model=64, n_layers=61, n_heads=4, d_ff=256, tie_embeddings=False)
    e61 = MoEConfig(num_experts=16, top_k=4, every=1, first_moe_layer=3, d_ff=32)
    plan = ParallelPlan(pp=16, microbatches=16, pp_layers="auto").validate(16, m61, e61, 16, 64)
    counts = [int(c) for c in plan.pp_layers.split(",")]
    assert sum(counts) == 61 and len(counts) == 16 and min(counts) >= 1


@pytest.mark.parametrize("spec, n, pattern", [
    (dict(pp=2, microbatches=2), 5, r"model\.n_layers=5 is not divisible by the 2 pipeline stages; set parallel\.pp_layers=auto"),
    (dict(pp=2, microbatches=2, pp_layers="2,2"), 5, r"pp_layers='2,2' lists 2 stages holding 4 blocks"),
    (dict(pp=2, microbatches=2, pp_layers="1,x"), 5, r"pp_layers='1,x' must be '' \(even\), 'auto'"),
    (dict(pp=4, microbatches=4, pp_layers="2,0,2,1"), 5, r"each >= 1 but the first and the last"),
    (dict(pp=2, microbatches=2, pp_layers="0,0"), 5, r"each >= 1 but the first and the last"),
    (dict(pp_layers="auto"), 5, r"pp_layers='auto' needs parallel\.pp > 1"),
    (dict(pp=4, microbatches=4, pp_layers="auto"), 1, r"1 blocks cannot fill 4 pipeline stages, even with "
                                                       r"the embedding and the head and loss as stages"),
])
def test_refusals_name_the_field(spec, n, pattern):
    m, e = _cfgs(n_layers=n)
    world = spec.get("pp", 1)
    with pytest.raises(ValueError, match=pattern):
        ParallelPlan(**spec).validate(world, m, e if n >= 2 else None, 8, 16)


def test_ends_may_hold_no_block():
    """Megatron's account-for-embedding / -loss split: with fewer blocks than stages, auto
    gives the head and loss a stage of their own (one block short) and the embedding too (two
    short), Qwen3-235B's 94 blocks over PP32 x VP3; an explicit 0 is allowed at either end."""
    m, e = _cfgs(n_layers=3)
    assert ParallelPlan(pp=4, microbatches=4, pp_layers="auto").validate(4, m, e, 8, 16).pp_layers == "1,1,1,0"
    m, e = _cfgs(n_layers=2)
    assert ParallelPlan(pp=4, microbatches=4, pp_layers="auto").validate(4, m, e, 8, 16).pp_layers == "0,1,1,0"
    m, e = _cfgs(n_layers=5)
    assert ParallelPlan(pp=2, microbatches=2, pp_layers="0,5").validate(2, m, e, 8, 16).pp_layers == "0,5"
    from parallel.pipeline.layers import ends_alone
    counts = ends_alone(94, 96)
    assert counts[0] == counts[-1] == 0 and counts[1:-1] == [1] * 94


def test_each_pipeline_rank_holds_its_listed_blocks():
    from parallel.planner.rank_state import read_rank_state
    m, e = _cfgs(n_layers=7)
    plan = ParallelPlan(pp=2, microbatches=4, pp_layers="1,2,3,1",
                        pp_schedule="interleaved_1f1b", ep=2, dp=2).validate(4, m, e, 8, 16)

    def build():
        return build_model(m, e, device="meta")
    ids = [read_rank_state(build, plan, r * plan.pool).block_ids for r in range(2)]
    assert ids == [[0, 3, 4, 5], [1, 2, 6]]
