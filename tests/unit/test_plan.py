"""ParallelPlan.validate: pure arithmetic for many world sizes, no communication."""
import itertools

import pytest

from models.config import ModelConfig, MoEConfig
from parallel.plan import ParallelPlan

MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=8, n_heads=8, d_ff=128, tie_embeddings=False)
MOE = MoEConfig(num_experts=8, top_k=2, every=2)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12, 16, 64])
def test_every_consistent_layout_validates_and_resolves_dp(world):
    ok = 0
    for tp, pp in itertools.product(_divisors(world), repeat=2):
        if world % (tp * pp):
            with pytest.raises(ValueError, match=r"parallel\.tp\*pp"):
                ParallelPlan(tp=tp, pp=pp).validate(world)
            continue
        dp = world // (tp * pp)
        for ep in _divisors(dp * tp):
            plan = ParallelPlan(tp=tp, pp=pp, ep=ep).validate(world)
            assert (plan.dp, plan.dp * plan.tp * plan.pp, plan.edp * plan.ep) == (dp, world, dp * tp)
            ok += 1
    assert ok >= 1


def test_validate_returns_copy_and_keeps_explicit_dp():
    plan = ParallelPlan(dp=-1, tp=2)
    resolved = plan.validate(8)
    assert plan.dp == -1 and resolved.dp == 4
    assert ParallelPlan(dp=2, tp=2, pp=2).validate(8).dp == 2


@pytest.mark.parametrize("kwargs, world, pattern", [
    (dict(dp=3), 4, r"parallel\.dp\*tp\*pp = 3\*1\*1 = 3 but the world size is 4"),
    (dict(tp=0), 4, r"parallel\.tp=0 must be an integer >= 1"),
    (dict(dp=0), 4, r"parallel\.dp=0 must be -1"),
    (dict(zero=4), 4, r"parallel\.zero=4 must be 0, 1, 2 or 3"),
    (dict(pp_schedule="zb"), 4, r"parallel\.pp_schedule='zb' is not supported"),
    (dict(precision="fp4"), 4, r"parallel\.precision='fp4'"),
    (dict(recompute="some"), 4, r"parallel\.recompute='some'"),
    (dict(compile="yes"), 4, r"parallel\.compile='yes' must be true, false or auto"),
    (dict(ep=3), 4, r"parallel\.ep=3 must divide dp\*tp"),
    (dict(tp=4, pp=1, ep=8), 4, r"parallel\.ep=8 must divide dp\*tp = 1\*4 = 4"),
    (dict(pp_stages_per_rank=2, pp=2), 4, r"needs a multi-stage schedule, parallel\.pp_schedule=interleaved_1f1b"),
    (dict(pp_stages_per_rank=2), 4, r"needs parallel\.pp > 1"),
])
def test_bad_plans_name_the_field(kwargs, world, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelPlan(**kwargs).validate(world)


@pytest.mark.parametrize("kwargs, world, model_kw, moe_kw, pattern", [
    (dict(tp=3), 3, dict(), dict(), r"model\.n_heads=8 is not divisible by parallel\.tp=3"),
    (dict(tp=2), 2, dict(vocab_size=255), dict(), r"model\.vocab_size=255 .* parallel\.tp=2"),
    (dict(tp=4), 4, dict(d_ff=130), dict(), r"model\.d_ff=130"),
    (dict(pp=3), 3, dict(), dict(), r"model\.n_layers=8 .* 3 pipeline stages"),
    (dict(pp=2, pp_schedule="interleaved_1f1b"), 2, dict(n_layers=6), dict(),
     r"model\.n_layers=6 .* 4 pipeline stages"),
    (dict(ep=4), 4, dict(), dict(num_experts=6), r"moe\.num_experts=6 .* parallel\.ep=4"),
    (dict(ep=2), 2, dict(), dict(every=0), r"parallel\.ep=2 needs MoE layers"),
    (dict(tp=2), 2, dict(arch="switch"), dict(), r"model\.arch='gpt' only"),
])
def test_model_divisibility_errors(kwargs, world, model_kw, moe_kw, pattern):
    model = ModelConfig(**{**MODEL.__dict__, **model_kw})
    moe = MoEConfig(**{"num_experts": 8, "top_k": 2, "every": 2, **moe_kw})
    with pytest.raises(ValueError, match=pattern):
        ParallelPlan(**kwargs).validate(world, model, moe)


def test_fp16_refused_with_pipeline_and_tied_embeddings_accepted():
    with pytest.raises(ValueError, match=r"parallel\.precision='fp16' .* parallel\.pp=2.*bf16"):
        ParallelPlan(pp=2, precision="fp16").validate(2)
    tied = ModelConfig(**{**MODEL.__dict__, "tie_embeddings": True})
    assert ParallelPlan(pp=2).validate(2, tied, MOE).pp == 2  # stages share it (TiedEmbedding)


def test_model_checks_pass_for_a_full_layout():
    plan = ParallelPlan(dp=2, tp=2, pp=2, ep=4, zero=1, microbatches=2).validate(8, MODEL, MOE, 8)
    assert (plan.dp, plan.edp, plan.num_stages) == (2, 1, 2)
    inter = ParallelPlan(pp=2, pp_schedule="interleaved_1f1b", microbatches=2).validate(4, MODEL, MOE, 8)
    assert (inter.stages_per_rank, inter.num_stages) == (2, 4)


@pytest.mark.parametrize("kwargs, world, batch, pattern", [
    (dict(), 4, 6, r"train\.batch_size=6 .* parallel\.dp=4"),
    (dict(pp=2, microbatches=3), 4, 8, r"not divisible by parallel\.microbatches=3"),
    (dict(pp=2, microbatches=1), 2, 8, r"parallel\.microbatches=1 is less than parallel\.pp=2"),
])
def test_batch_errors(kwargs, world, batch, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelPlan(**kwargs).validate(world, MODEL, MOE, batch)


def test_tp_micro_batch_of_one_needs_dropless_token_choice():
    """Dropless token choice routes tp's sequence split as it is (any micro-batch size); a
    capacity (in training or only in eval) or expert choice needs whole sequences per tp rank."""
    assert ParallelPlan(tp=2).validate(4, MODEL, MOE, 2).tp == 2       # micro-batch 1 at tp2
    same = MoEConfig(num_experts=8, top_k=2, every=2, eval_capacity_factor="Same")  # = dropless
    assert ParallelPlan(tp=2).validate(4, MODEL, same, 2).tp == 2
    whole = [MoEConfig(num_experts=8, top_k=2, every=2, capacity_factor=1.25),
             MoEConfig(num_experts=8, top_k=2, every=2, eval_capacity_factor=2.0),
             MoEConfig(num_experts=8, top_k=2, every=2, router="expert_choice", capacity_factor=1.0)]
    for moe in whole:
        with pytest.raises(ValueError, match=r"microbatch size 1 sequences is not divisible by "
                                             r"parallel\.tp=2: MoE layers with a capacity or "
                                             r"expert choice route whole sequences"):
            ParallelPlan(tp=2).validate(4, MODEL, moe, 2)
    with pytest.raises(ValueError, match=r"under tp_mode=2d MoE layers split whole sequences"):
        ParallelPlan(tp=4, tp_mode="2d").validate(4, MODEL, MOE, 2)


def test_gpipe_accepts_fewer_microbatches_and_dense_tp_needs_no_batch_split():
    ParallelPlan(pp=2, pp_schedule="gpipe", microbatches=1).validate(2, MODEL, MOE, 4)
    dense = MoEConfig(num_experts=8, top_k=2, every=0)
    ParallelPlan(tp=2).validate(2, MODEL, dense, 1)


@pytest.mark.parametrize("tp, seq_len, ok", [(2, 127, False), (4, 126, False), (2, 128, True),
                                             (1, 127, True)])
def test_seq_len_must_split_evenly_over_tp(tp, seq_len, ok):
    plan = ParallelPlan(tp=tp)
    if ok:
        plan.validate(tp, MODEL, MOE, 8, seq_len)
        return
    with pytest.raises(ValueError, match=rf"data\.seq_len={seq_len} is not divisible by parallel\.tp={tp}"):
        plan.validate(tp, MODEL, MOE, 8, seq_len)


def _suggested(msg: str) -> dict:
    """The `parallel.X=N` settings a message proposes, as a dict."""
    import re
    return {k: int(v) for k, v in re.findall(r"parallel\.(\w+)=(-?\d+)", msg)}


@pytest.mark.parametrize("kwargs, world", [
    (dict(dp=2, tp=2, pp=2, ep=2, zero=1, microbatches=2), 2),   # configs/layout_hybrid_w8.toml
    (dict(dp=2, tp=2, pp=2, microbatches=2), 4),
    (dict(dp=1, tp=4, pp=1), 2),
    (dict(dp=4, tp=2), 2),                                       # dp=-1 alone is the fix here
])
def test_explicit_dp_error_names_a_fix_that_validates_in_one_go(kwargs, world):
    with pytest.raises(ValueError) as err:
        ParallelPlan(**kwargs).validate(world, MODEL, MOE, 8)
    msg = str(err.value)
    fix = _suggested(msg.split("; ", 1)[1])
    assert fix.get("dp") == -1, msg
    fixed = ParallelPlan(**{**kwargs, **fix}).validate(world, MODEL, MOE, 8)
    assert fixed.world == world


def test_tp_pp_not_dividing_world_suggests_degrees_that_do():
    with pytest.raises(ValueError, match=r"tp\*pp = 2\*2 = 4 does not divide the world size 6") as err:
        ParallelPlan(tp=2, pp=2).validate(6)
    fix = _suggested(str(err.value))
    assert fix == {"tp": 2, "pp": 1}
    assert ParallelPlan(**fix).validate(6).dp == 3


@pytest.mark.parametrize("kwargs, world, pattern", [
    (dict(offload="disk", zero=1), 2, r"parallel\.offload='disk' is not supported; use one of none, optimizer, params"),
    (dict(offload="optimizer"), 2, r"parallel\.offload='optimizer' needs .* set parallel\.zero=1, 2 or 3"),
    (dict(offload="params", zero=2), 2, r"parallel\.offload='params' .* set parallel\.zero=3"),
    (dict(zeropp_quantize_weights=True, zero=2), 2, r"parallel\.zeropp_quantize_weights=true .* set parallel\.zero=3"),
    (dict(zeropp_quantize_weights=1, zero=3), 2, r"parallel\.zeropp_quantize_weights=1 must be true or false"),
    (dict(zeropp_quantize_grads=True, zero=1), 2, r"parallel\.zeropp_quantize_grads=true .* set parallel\.zero=2 or 3"),
    (dict(zeropp_hpz=2, zero=2), 4, r"parallel\.zeropp_hpz=2 .* set parallel\.zero=3"),
    (dict(zeropp_hpz=3, zero=3), 4, r"parallel\.zeropp_hpz=3 must divide parallel\.dp=4 and be smaller"),
    (dict(zeropp_hpz=4, zero=3), 4, r"parallel\.zeropp_hpz=4 must divide parallel\.dp=4 and be smaller"),
    (dict(zeropp_hpz=-1, zero=3), 4, r"parallel\.zeropp_hpz=-1 must be 0"),
])
def test_zero_family_flags_name_the_stage_they_need(kwargs, world, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelPlan(**kwargs).validate(world)


def test_zero_family_combinations_that_work_validate():
    for kwargs in (dict(zero=1, offload="optimizer"), dict(zero=2, offload="optimizer", zeropp_quantize_grads=True),
                   dict(zero=3, offload="params", zeropp_quantize_weights=True, zeropp_quantize_grads=True),
                   dict(zero=3, offload="optimizer", zeropp_hpz=2), dict(zero=3, offload="params", zeropp_hpz=2)):
        assert ParallelPlan(**kwargs).validate(4).offload == kwargs.get("offload", "none")


@pytest.mark.parametrize("kwargs,world,model_kw,moe_kw,pattern", [
    (dict(dp=4, ep=2, etp=4), 4, {}, {}, r"parallel\.ep\*etp = 2\*4 must divide dp\*tp = 4\*1"),
    (dict(dp=4, etp=0), 4, {}, {}, r"parallel\.etp=0 must be an integer >= 1"),
    (dict(dp=4, etp=4), 4, {}, {"d_ff": 66}, r"d_ff=66 .* not divisible by parallel\.etp=4"),
    (dict(dp=2, etp=2), 2, {"bias": True}, {}, r"parallel\.etp=2 with model\.bias=true.*model\.bias=false"),
    (dict(dp=4, ep=2, etp=2), 4, {}, {"replica_slots": 1}, r"moe\.replica_slots=1 with parallel\.etp=2"),
    (dict(dp=2, etp=2), 2, {}, {"every": 0}, r"parallel\.etp=2 splits routed experts.*etp=1"),
])
def test_expert_tensor_parallel_refusals_name_the_field(kwargs, world, model_kw, moe_kw, pattern):
    model = ModelConfig(**{**MODEL.__dict__, **model_kw})
    moe = MoEConfig(**{**MOE.__dict__, **moe_kw})
    with pytest.raises(ValueError, match=pattern):
        ParallelPlan(**kwargs).validate(world, model, moe)


def test_expert_tensor_parallel_folds_over_the_stage_pool():
    """etp is independent of tp: the expert side regroups each stage's dp*tp ranks."""
    plan = ParallelPlan(dp=2, tp=4, ep=2, etp=2).validate(8, MODEL, MOE)
    assert (plan.edp, plan.ep, plan.etp) == (2, 2, 2)
    assert "etp=2" in plan.summary() and "etp" not in ParallelPlan().validate(1).summary()
    from parallel.mesh import rank_groups
    groups = rank_groups(plan)
    assert groups["etp"][:2] == [[0, 1], [2, 3]]   # innermost: neighbouring ranks
    assert groups["ep"][:2] == [[0, 2], [1, 3]]
    assert groups["edp"][:2] == [[0, 4], [1, 5]]


@pytest.mark.parametrize("kwargs,world,model_kw,batch,pattern", [
    (dict(pp=2, pp_schedule="zbv", microbatches=2), 2, {"tie_embeddings": True}, None,
     r"pp_schedule=zbv with model\.tie_embeddings=true.*tie_embeddings=false or use pp_schedule=zb_interleaved"),
    (dict(pp=2, pp_schedule="dualpipev", microbatches=2), 2, {}, 8,
     r"microbatches=2: pp_schedule dualpipev needs at least one microbatch per stage \(4"),
    (dict(pp=2, pp_schedule="zb_interleaved", microbatches=5), 2, {}, 40,
     r"zb_interleaved runs rounds of parallel\.pp=2 microbatches \(2 here\).*multiple of 2"),
    (dict(dp=2, pp=2, zero=3, pp_schedule="zbv", microbatches=2), 4, {}, 8,
     r"pp_schedule=zbv with parallel\.zero=3.*zero=1 or 2"),
    (dict(pp=2, pp_schedule="zbv", pp_stages_per_rank=3), 2, {}, None,
     r"zbv places exactly 2 stages per rank"),
])
def test_zero_bubble_refusals_name_the_field(kwargs, world, model_kw, batch, pattern):
    model = ModelConfig(**{**MODEL.__dict__, "n_layers": 12, "tie_embeddings": False, **model_kw})
    with pytest.raises(ValueError, match=pattern):
        ParallelPlan(**kwargs).validate(world, model, MOE, batch)


def test_zero_bubble_schedules_place_their_stages():
    v = ParallelPlan(pp=4, pp_schedule="dualpipev", microbatches=8).validate(4)
    assert v.stages_per_rank == 2 and [v.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    looped = ParallelPlan(pp=4, pp_schedule="zb_interleaved").validate(4)
    assert [looped.stages_of(r) for r in range(2)] == [[0, 4], [1, 5]]


@pytest.mark.parametrize("kwargs,world,model_kw,batch,pattern", [
    (dict(tp=2, tp_mode="2d"), 2, {}, None, r"parallel\.tp=2 with tp_mode='2d' must be q\*q.*tp=4"),
    (dict(tp=8, tp_mode="2d"), 8, {}, None, r"parallel\.tp=8 with tp_mode='2d' must be q\*q"),
    (dict(tp=8, tp_mode="2.5d", tp_depth=3), 8, {}, None, r"tp_depth=3\).*tp=12 \(q=2\)"),
    (dict(tp=4, tp_depth=2), 4, {}, None, r"parallel\.tp_depth=2 stacks 2-D grids and needs parallel\.tp_mode='2\.5d'"),
    (dict(tp=4, tp_mode="3d"), 4, {}, None, r"parallel\.tp_mode='3d' is not supported; use one of 1d, 2d, 2\.5d"),
    (dict(tp=4, tp_mode="2d", zero=3, dp=1), 4, {}, None, r"tp_mode=2d with parallel\.zero=3.*zero=1 or 2"),
    (dict(tp=4, tp_mode="2d", compile=True), 4, {}, None, r"tp_mode=2d with parallel\.compile=true"),
    (dict(tp=9, tp_mode="2d"), 9, {}, None, r"model\.n_heads=8 is not divisible by the grid side q=3"),
    (dict(tp=4, tp_mode="2d"), 4, {"bias": True}, None, r"tp_mode=2d with model\.bias=true.*model\.bias=false"),
    (dict(tp=8, tp_mode="2.5d", tp_depth=2), 8, {}, 6, r"microbatch size 6 sequences is not "
     r"divisible by 4 \(parallel\.tp_mode=2\.5d splits the batch over tp_depth x q = 2 x 2 grid rows\)"),
    (dict(tp=4, tp_mode="2d"), 4, {}, 2, r"microbatch size 2 .* by parallel\.tp=4: under tp_mode=2d MoE layers split whole"),
])
def test_grid_tensor_parallel_refusals_name_the_field(kwargs, world, model_kw, batch, pattern):
    model = ModelConfig(**{**MODEL.__dict__, **model_kw})
    with pytest.raises(ValueError, match=pattern):
        ParallelPlan(**kwargs).validate(world, model, MOE, batch)


def test_grid_tensor_parallel_groups_and_summary():
    """tp rank t of a 2.5d plan sits at (t // q^2, (t // q) % q, t % q) of (tpd, tpr, tpc)."""
    from parallel.mesh import rank_groups
    plan = ParallelPlan(tp=8, tp_mode="2.5d", tp_depth=2).validate(8, MODEL, MOE, 8)
    assert plan.tp_grid == 2 and "tp_mode=2.5d tp_depth=2" in plan.summary()
    groups = rank_groups(plan)
    assert groups["tpc"][:2] == [[0, 1], [2, 3]]   # a grid row: splits the hidden dim
    assert groups["tpr"][:2] == [[0, 2], [1, 3]]   # a grid column: splits the batch
    assert groups["tpd"][:2] == [[0, 4], [1, 5]]   # the stacked grids
    assert "tpc" not in rank_groups(ParallelPlan(tp=4).validate(4))
    # the grid splits no sequence: a seq_len 1d's sequence parallelism refuses is fine here
    ParallelPlan(tp=4, tp_mode="2d").validate(4, MODEL, MOE, 8, seq_len=30)


@pytest.mark.parametrize("kwargs,world,pattern", [
    (dict(pp=2, pp_schedule="2bw", microbatches=1), 2, r"2bw with parallel\.microbatches=1 < parallel\.pp=2"),
    (dict(pp=2, tp=2, pp_schedule="2bw"), 4, r"2bw with parallel\.tp=2: set tp=1"),
    (dict(pp=2, dp=2, ep=2, pp_schedule="2bw"), 4, r"2bw with parallel\.ep/etp > 1"),
    (dict(pp=2, dp=2, zero=1, pp_schedule="2bw"), 4, r"2bw with parallel\.zero=1: the stashed weight"),
    (dict(pp=2, recompute="full", pp_schedule="2bw"), 2, r"2bw with parallel\.recompute=full"),
    (dict(pp=2, precision="bf16", pp_schedule="2bw"), 2, r"2bw with parallel\.precision=bf16"),
    (dict(pp=2, pp_schedule="2bw"), 2, r"2bw with model\.tie_embeddings=true.*tie_embeddings=false"),
])
def test_2bw_refusals_name_the_field(kwargs, world, pattern):
    model = ModelConfig(**{**MODEL.__dict__, "tie_embeddings": "tie_embeddings" in pattern})
    with pytest.raises(ValueError, match=pattern):
        ParallelPlan(**kwargs).validate(world, model, MOE, 8)


def test_bf16_parameters_with_tensor_parallel_zero_slices_are_refused_in_one_line():
    """parallel.param_dtype=bf16 casts the parameters beside ZeRO-1/2's fp32 slices; a
    tensor-parallel DTensor weight kept an fp32 local block and the first forward failed."""
    for zero in (1, 2):
        with pytest.raises(ValueError, match=rf"parallel.param_dtype=bf16 with parallel.tp=2 under "
                                             rf"ZeRO-{zero}: casting tensor-parallel weights"):
            ParallelPlan(tp=2, zero=zero, precision="bf16", param_dtype="bf16").validate(4, MODEL, MOE, 8)
    ParallelPlan(tp=2, zero=1, precision="bf16").validate(4, MODEL, MOE, 8)   # fp32 parameters
