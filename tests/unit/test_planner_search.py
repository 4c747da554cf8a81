"""The bounded best-first search (parallel/planner/search.py) against the exhaustive one:
the same top list, in the same order, at world 8 with cp 1 and 2 (configs/gshard_gpt.toml on
H100s, where memory binds: the memory bounds prune too), and every bound below the prediction
it bounds; the search's shared reads (pipeline ranks of one shape) give the exhaustive
search's step times exactly. World 16 (hpZ exists there: 8-GPU nodes) in a space cut to
ZeRO-3 with and without ZeRO++ (42 s); the whole world-16 space (150 s of exhaustive search,
over the suite's budget) is compared by `python bench/planner_scale.py` (same top 10)."""
import dataclasses
from pathlib import Path

import pytest

from parallel.planner import StateCache, preset
from parallel.planner.flops import model_costs
from parallel.planner.report import layout_name, plan_all
from parallel.planner.flops import model_flops
from parallel.planner.step_time import fp8_gemm_time
from parallel.planner.enumerate import variants
from parallel.planner.search import (_stage_blocks, memory_bound, search, state_bytes,
                                     structure_bound, variant_bound)
from trainer.config import load_config
from trainer.planning import workload_from_config

ROOT = Path(__file__).resolve().parents[2]
KW = dict(zeros=(0, 1, 2, 3), offloads=("none", "optimizer"), zeropp=(False, True))
CPS = {8: (1, 2)}


@pytest.fixture(scope="module")
def gshard():
    cfg = load_config(str(ROOT / "configs" / "gshard_gpt.toml"), [])
    w = workload_from_config(cfg)
    return cfg, w, model_costs(w.build_model(), w)


@pytest.mark.long
@pytest.mark.parametrize("world, precision", [(8, "fp32")])
def test_search_top_list_equals_the_exhaustive_one(gshard, world, precision):
    """(precision=fp8's bounds: tests/unit/test_planner_fp8.py)"""
    cfg, w, costs = gshard
    hw = preset("h100")
    base = dataclasses.replace(cfg.parallel, precision=precision)
    full = plan_all(w, base, world, hw, costs, StateCache(w.build_model), cps=CPS[world], **KW)
    # the search shares reads between pipeline ranks of the same shape (StateCache with the
    # workload) and copies one rank's blocks per read; the exhaustive reference does neither
    fast = search(w, base, world, hw, costs, StateCache(w.build_model, w), top=10, cps=CPS[world], **KW)
    want = [(layout_name(p.plan), p.step_s) for p in full["fits"][:10]]
    got = [(layout_name(p.plan), p.step_s) for p in fast["fits"][:10]]
    assert len(want) == 10 and got == want
    assert fast["predicted"] < (len(full["fits"]) + len(full["too_big"])) / 4  # it did prune
    # the bounds never exceed what they bound (a bound above a prediction could drop a layout)
    sizes = state_bytes(w.build_model())
    for p in full["fits"][::7] + full["too_big"][::7]:
        stages = _stage_blocks(w, p.plan)
        assert variant_bound(w, p.plan, costs, hw, sizes, stages) <= p.step_s * (1 + 1e-9), layout_name(p.plan)
        assert memory_bound(w, p.plan, sizes) <= p.peak_bytes * (1 + 1e-9), layout_name(p.plan)
        s = {k: getattr(p.plan, k) for k in ("dp", "tp", "tp_mode", "tp_depth", "pp", "cp", "cp_mode", "ep", "etp")}
        compute_s = model_flops(costs, w, w.imbalance if s["ep"] > 1 else 1.0) / (hw.tflops * 1e12) / world
        compute_s *= fp8_gemm_time(base, hw)
        zero_variants = variants(s, KW["zeros"], KW["offloads"], KW["zeropp"], 8)
        assert structure_bound(w, base, s, hw, sizes, compute_s, zero_variants) <= \
            p.step_s * (1 + 1e-9), layout_name(p.plan)


@pytest.mark.long
def test_search_equals_the_exhaustive_one_at_world_16_where_hpz_exists(gshard):
    """World 16 on 8-GPU nodes: ZeRO-3 with and without ZeRO++ (hpZ over a node's ranks is a
    variant of its own, with a smaller memory bound than the plain one), cp 1, 20 GB per GPU
    so memory prunes: the search's top 10 equals the exhaustive one's (the space cut to ZeRO-3
    and no offload keeps the exhaustive reference to seconds; bench/planner_scale.py runs the
    whole space)."""
    cfg, w, costs = gshard
    hw = dataclasses.replace(preset("h100"), gpu_mem_gb=20.0)
    kw = dict(zeros=(3,), offloads=("none",), zeropp=(False, True), cps=(1,))
    full = plan_all(w, cfg.parallel, 16, hw, costs, StateCache(w.build_model), **kw)
    fast = search(w, cfg.parallel, 16, hw, costs, StateCache(w.build_model, w), top=10, **kw)
    want = [(layout_name(p.plan), p.step_s) for p in full["fits"][:10]]
    got = [(layout_name(p.plan), p.step_s) for p in fast["fits"][:10]]
    assert len(want) == 10 and got == want
    assert any(p.plan.zeropp_hpz for p in full["fits"] + full["too_big"])  # hpZ was in play


def test_a_lower_memory_keeps_only_layouts_that_fit(gshard):
    cfg, w, costs = gshard
    hw = dataclasses.replace(preset("h100"), gpu_mem_gb=20.0)
    fast = search(w, cfg.parallel, 16, hw, costs, StateCache(w.build_model), top=5, cps=(1, 2), **KW)
    assert fast["fits"] and all(p.peak_bytes <= 20e9 for p in fast["fits"])
    assert fast["bounded_overflow"] + fast["overflow_groups"] > 0


def test_a_group_stays_while_any_of_its_leanest_variants_may_fit(gshard, monkeypatch):
    """The group prune bounds a structure's memory by its leanest layouts: the highest ZeRO
    stage and deepest offload in every ZeRO++ form (hpZ, quantized). Were one of them taken
    for all (it was: the first), a group whose hpZ variant fits but whose plain one does not
    would be dropped with a layout that fits (issue 46): here only hpZ "fits"."""
    from parallel.planner import search as search_mod
    cfg, w, costs = gshard
    s = dict(dp=16, tp=1, tp_mode="1d", tp_depth=1, pp=1, cp=1, cp_mode="ring", ep=8, etp=1)
    seen = []

    def bound(w_, plan, sizes):
        seen.append(plan.zeropp_hpz)
        return 1.0 if plan.zeropp_hpz else 1e30
    monkeypatch.setattr(search_mod, "memory_bound", bound)
    hw = dataclasses.replace(preset("h100"), gpu_mem_gb=1.0)
    groups = search_mod._groups(w, cfg.parallel, s, 16, hw, costs, state_bytes(w.build_model()), {},
                                (3,), ("none", "full"), ("none",), (False, True), 8)
    assert 8 in seen and 0 in seen        # hpZ over the node's 8 ranks, and without it
    assert groups and all(g is not None for g in groups), groups


@pytest.mark.parametrize("over, layout", [
    (["moe.a2a_overlap_degree=4"], dict(dp=8, ep=8)),
    (["moe.a2a_overlap_degree=4"], dict(dp=4, ep=4, pp=2, microbatches=8)),
    (["train.micro_batch_size=1"], dict(dp=8, ep=8, a2a_overlap="1f1b")),
])
def test_bounds_stay_below_predictions_that_hide_the_all_to_all(over, layout):
    """Under an all-to-all overlap the prediction takes off what it hides (step_time.py), so
    the search's bounds leave the all-to-all out (else a bound could exceed the prediction
    and drop a layout from the top list)."""
    from parallel.planner import predict
    cfg = load_config(str(ROOT / "configs" / "gshard_gpt.toml"), over)
    w = workload_from_config(cfg)
    hw = preset("h100")
    plan = w.validate(dataclasses.replace(cfg.parallel, **layout), 8)
    costs = model_costs(w.build_model(), w)
    p = predict(w, plan, hw, costs, StateCache(w.build_model))
    alone = predict(w, w.validate(dataclasses.replace(plan, a2a_overlap="none"), 8) if
                    plan.a2a_overlap == "1f1b" else plan, hw, costs, StateCache(w.build_model))
    assert p.rank0().comm_s["expert_all_to_all"] > 0
    sizes = state_bytes(w.build_model())
    assert variant_bound(w, plan, costs, hw, sizes, _stage_blocks(w, plan)) <= p.step_s * (1 + 1e-9)
    s = {k: getattr(plan, k) for k in ("dp", "tp", "tp_mode", "tp_depth", "pp", "cp", "cp_mode", "ep", "etp")}
    compute_s = model_flops(costs, w, w.imbalance) / (hw.tflops * 1e12) / 8
    zero_variants = variants(s, KW["zeros"], KW["offloads"], KW["zeropp"], 8)
    assert structure_bound(w, plan, s, hw, sizes, compute_s, zero_variants) <= p.step_s * (1 + 1e-9)
    if plan.a2a_overlap == "1f1b":
        assert p.step_s < alone.step_s  # the overlap's gain is in the prediction
