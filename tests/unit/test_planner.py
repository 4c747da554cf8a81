"""The layout planner's command line on every shipped config, and its small invariants.
(Predictions against measured runs: tests/e2e/test_planner_validation.py.)"""
import ast
import json
import re
from pathlib import Path

import pytest

from parallel.ledger import KINDS
from commands.plan import main
from parallel.pipeline.schedules import bubble_fraction, in_flight
from parallel.planner.step_time import TERM_EVIDENCE

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_cli_json_on_every_config(config, capsys):
    # zero 0 and cp 1, 2 only keep it quick (fewer meta parallelizations); test_text_output
    # runs all
    assert main(["--config", str(config), "--world", "8", "--zero", "0", "--cp", "1", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world"] == 8
    assert out["fits"] or out["too_big"], "no layout of world 8 was predicted"
    steps = [p["step_s"] for p in out["fits"]]
    assert steps == sorted(steps)
    for p in out["fits"] + out["too_big"]:
        lay = p["layout"]
        assert lay["dp"] * lay["cp"] * lay["tp"] * lay["pp"] == 8
        assert (p["peak_bytes"] <= 80e9) == p["fits"]
        assert len(p["ranks"]) == lay["pp"]
        for r in p["ranks"]:
            assert set(r["comm_bytes"]) <= set(KINDS)
            assert r["model_state_bytes"]["params"]["gpu"] > 0
            # the stage's step by part (step_time.stage_breakdown): the parts sum to it, and
            # --layout can say where each comes from
            parts = r["breakdown_s"]
            assert abs(sum(parts.values()) - r["step_s"]) <= 1e-9 * r["step_s"], (parts, r["step_s"])
            assert set(parts) <= set(TERM_EVIDENCE) and parts["gemm"] > 0
    for bad in out["invalid"]:
        assert bad["reason"]


def test_text_output_names_refusals(capsys):
    cfg = ROOT / "configs" / "default.toml"
    assert main(["--config", str(cfg), "--world", "8", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "fits (fastest first):" in text
    # the refusals the search reached, counted with validate's own message
    assert "cannot fill 8 pipeline stages, even with the embedding and the head and loss as stages of their own; lower parallel.pp" in text
    assert "parallel.pp_schedule=2bw with parallel.ep/etp > 1" in text
    # a pipeline rank whose blocks are all dense is planned under ep (it used to be refused)
    assert "no MoELayer" not in text
    # layouts the search never reached (bounded slower) are not listed; --layout names
    # validate's reason for any of them (cp enumerated, its refusals named)
    for layout, reason in (("tp8", "model.n_heads=4 is not divisible by parallel.tp=8"),
                           ("cp2 pp2 m2 zbv", "parallel.cp=2 with parallel.pp_schedule=zbv")):
        assert main(["--config", str(cfg), "--world", "8", "--layout", layout]) == 2
        assert reason in capsys.readouterr().err, layout


def test_bad_override_is_reported(capsys):
    assert main(["--world", "2", "model.d_modle=3"]) == 2
    assert "did you mean 'model.d_model'" in capsys.readouterr().err


def test_bubble_and_in_flight():
    assert bubble_fraction("1f1b", 1, 8) == 0.0
    assert bubble_fraction("gpipe", 4, 8) == bubble_fraction("1f1b", 4, 8) == 3 / 11
    assert bubble_fraction("interleaved_1f1b", 4, 8, chunks=2) == 3 / 19
    assert in_flight("gpipe", 4, 8, stage=0) == 8
    assert [in_flight("1f1b", 4, 8, stage=s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 2, stage=0) == 2
    # zero bubble at T_F = T_B = T_W: a third of the interleaved fill/drain, none for the V
    assert bubble_fraction("zb_interleaved", 4, 8, chunks=2) == 3 / 51
    assert bubble_fraction("zbv", 4, 8, chunks=2) == bubble_fraction("dualpipev", 4, 8, chunks=2) == 0.0
    assert in_flight("zbv", 4, 8, stage=0, chunks=2) == in_flight("dualpipev", 4, 2, stage=3, chunks=2) + 4 == 8


def test_planner_library_does_not_import_trainer():
    """Layering: only the command-line entry point (__main__.py) reads trainer's config."""
    for path in (ROOT / "parallel" / "planner").glob("*.py"):
        if path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("trainer", "train") for n in names), path


def test_state_cache_keeps_v_and_looped_placements_apart():
    """zbv and interleaved_1f1b both run 2 stages per rank but on different blocks: a state
    cached for one must not serve the other (it once did: stage peaks swapped)."""
    from trainer.config import load_config
    from parallel.planner import Hardware, StateCache, predict
    from trainer.planning import workload_from_config
    from parallel.planner.flops import model_costs
    base = ["model.tie_embeddings=false", "parallel.pp=2", "parallel.microbatches=4"]

    def peaks(schedule, cache):
        cfg = load_config(None, base + [f"parallel.pp_schedule={schedule}"])
        w = workload_from_config(cfg)
        pred = predict(w, w.validate(cfg.parallel, 2), Hardware(), model_costs(w.build_model(), w), cache)
        return [st.memory["peak"] for st in pred.stages]

    w = workload_from_config(load_config(None, base))
    alone = peaks("zbv", StateCache(w.build_model))
    shared = StateCache(w.build_model)
    peaks("interleaved_1f1b", shared)
    assert peaks("zbv", shared) == alone


def test_one_read_serves_every_split_of_the_replicas_into_cp():
    """StateCache reads a layout once per dp x cp product: the split into row streams and
    sequence parts (and ring / ulysses) changes no tensor, bucket or unit, only the cp group
    (rank_state.with_cp). Read each split for real and compare, at ZeRO 1 and 3 under ep."""
    import dataclasses
    from parallel.planner.rank_state import read_rank_state, with_cp
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    w = workload_from_config(load_config(None, ["model.n_layers=2"]))

    def read(**kw):
        plan = w.validate(dataclasses.replace(w_base, **kw), 8)
        return read_rank_state(w.build_model, plan, 0)
    w_base = load_config(None, []).parallel
    for zero in (1, 3):
        flat = read(dp=8, cp=1, ep=2, zero=zero)
        for dp, cp, mode in ((4, 2, "ring"), (2, 4, "ulysses"), (1, 8, "ring")):
            real = read(dp=dp, cp=cp, cp_mode=mode, ep=2, zero=zero)
            derived = with_cp(flat, cp)
            assert real.groups["cp"] == (frozenset({"cp"}), cp)
            assert dataclasses.replace(derived, plan=real.plan) == real, (zero, dp, cp, mode)
            assert with_cp(real, 1) == dataclasses.replace(flat, plan=real.plan)


def test_overlap_lower_bound():
    """step_s_min <= step_s always; the expert all-to-all's hidden share follows
    moe.a2a_overlap_degree (d=4 hides 3/4 of it, so the bound drops by that much when compute
    covers it) and ZeRO-3's gathers hide under compute, in the prediction too (FSDP2's
    streams); dp=2 ZeRO-0 hides nothing."""
    from trainer.config import load_config
    from parallel.planner import Hardware, StateCache, predict
    from trainer.planning import workload_from_config
    from parallel.planner.flops import model_costs
    from parallel.planner.step_time import hideable_seconds

    def pred(*over):
        cfg = load_config(None, list(over))
        w = workload_from_config(cfg)
        return predict(w, w.validate(cfg.parallel, 2), Hardware(tflops=1.0), model_costs(w.build_model(), w),
                       StateCache(w.build_model))
    plain = pred("parallel.ep=2")
    chunked = pred("parallel.ep=2", "moe.a2a_overlap_degree=4")
    assert plain.step_s_min == plain.step_s
    a2a = chunked.rank0().comm_s["expert_all_to_all"]
    # the prediction takes off what the chunked overlap hides (3/4 of it), and its gain is
    # the throughput's: nothing else is hideable here, so the bound is the prediction
    assert a2a > 0 and chunked.step_s == pytest.approx(plain.step_s - 0.75 * a2a, rel=1e-9)
    assert chunked.step_s_min == chunked.step_s
    assert chunked.tflops_per_gpu == pytest.approx(plain.tflops_per_gpu * plain.step_s / chunked.step_s,
                                                   rel=1e-9)
    zero3 = pred("parallel.zero=3")
    hidden = hideable_seconds(zero3.rank0().comm_s, zero3.plan, 1)
    assert set(hidden) == {"zero_param_gather", "zero_grad_reduce_scatter"}
    # FSDP2 runs them on its own streams: the prediction hides them as the bound does (here
    # the compute outlasts them), none left in its parts
    bd = zero3.rank0().breakdown_s
    assert zero3.step_s_min == pytest.approx(zero3.step_s, rel=1e-12)
    assert not set(hidden) & set(bd) and bd.get("overlap_excess", 0.0) == 0.0
    assert zero3.step_s == pytest.approx(sum(bd.values()), rel=1e-12)
    dp = pred("parallel.dp=2")
    assert dp.step_s_min == dp.step_s


def test_1f1b_overlap_hides_the_paired_share_or_is_priced_by_the_schedule_simulation():
    """parallel.a2a_overlap=1f1b: without a pipeline all but 1/m of the expert all-to-all
    can hide (m = 4 micro-batches): the lower bound hides it, the prediction takes
    PAIR_HIDDEN_SHARE of it off (what Megatron-Core's pairs were measured to take). Under pp2
    zbv with 4 micro-batches the prediction is the plain schedule's pipelined work times the
    ratio of the two simulated schedules, with the pairs and without
    (parallel/pipeline/simulate.py), at this stage's costs, computed here from its FLOPs and
    all-to-all seconds, the pairs hiding PAIR_HIDDEN_SHARE of it; the lower bound still hides
    the paired share."""
    import dataclasses
    from parallel.pipeline.simulate import StepCost, simulate
    from parallel.planner import Hardware, StateCache, predict
    from parallel.planner.flops import model_costs
    from parallel.planner.comm import micro_count
    from parallel.planner.step_time import PAIR_HIDDEN_SHARE, paired_shares
    from trainer.config import load_config
    from trainer.planning import workload_from_config

    def pred(world, **kw):
        cfg = load_config(None, ["train.micro_batch_size=2"] if kw.get("pp", 1) == 1 else
                          ["model.tie_embeddings=false"])   # (zbv refuses tied ends)
        w = workload_from_config(cfg)
        plan = w.validate(dataclasses.replace(cfg.parallel, **kw), world)
        return predict(w, plan, Hardware(tflops=1.0), model_costs(w.build_model(), w),
                       StateCache(w.build_model)), micro_count(w, plan), w
    flat, m, _ = pred(2, dp=2, ep=2, a2a_overlap="1f1b")
    flat_plain, _, _ = pred(2, dp=2, ep=2)
    a2a = flat.rank0().comm_s["expert_all_to_all"]
    assert m >= 2 and a2a > 0
    assert flat.step_s == pytest.approx(flat_plain.step_s - PAIR_HIDDEN_SHARE * (1 - 1 / m) * a2a,
                                        rel=1e-9)
    assert flat.step_s_min == pytest.approx(flat_plain.step_s - (1 - 1 / m) * a2a, rel=1e-9)
    assert flat.tflops_per_gpu > flat_plain.tflops_per_gpu
    layout = dict(pp=2, dp=2, ep=2, microbatches=4, pp_schedule="zbv")
    piped, _, w = pred(4, **layout, a2a_overlap="1f1b")
    plain, _, _ = pred(4, **layout)
    shares = paired_shares(piped.plan, 4)
    for stage, alone, share in zip(piped.stages, plain.stages, shares):
        a2a = stage.comm_s["expert_all_to_all"]
        compute = stage.flops / 1e12   # Hardware(tflops=1.0); no other in-step traffic here
        assert set(stage.comm_s) <= {"expert_all_to_all", "dp_grad_reduce", "pipeline", "other"}
        work = compute + stage.comm_s.get("pipeline", 0.0) + (1 - PAIR_HIDDEN_SHARE) * a2a
        hideable = PAIR_HIDDEN_SHARE * a2a
        chunks, moe_blocks = 4 * 2, sum(map(w.is_moe_block, [0, 1, 2, 3])) // 2
        cost = StepCost(f=work / 3 / chunks, b=2 * work / 3 / chunks, a_f=hideable / 2 / chunks,
                        a_b=hideable / 2 / chunks, layers=max(1, moe_blocks))
        ratio = simulate("zbv", 2, 4, 2, dataclasses.replace(cost, paired=True)) / simulate("zbv", 2, 4, 2, cost)
        after = alone.step_s - (work + hideable) / (1 - piped.bubble)
        assert a2a > 0 and stage.step_s == pytest.approx((alone.step_s - after) * ratio + after, rel=1e-9)
        assert stage.a2a_exposed_s == pytest.approx((1 - share) * a2a, rel=1e-9)   # the bound's
        assert stage.step_s_min <= stage.step_s
    assert all(s.a2a_exposed_s == s.comm_s["expert_all_to_all"] for s in plain.stages)


def test_a_stage_without_moe_layers_is_planned_under_ep():
    """Default config (MoE blocks 1 and 3), pp=2 interleaved: rank 0 runs blocks 0 and 2, both
    dense, so it books no expert all-to-all and holds no expert bytes; rank 1 does both."""
    import dataclasses
    from parallel.planner import Hardware, StateCache, predict
    from parallel.planner.flops import model_costs
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    cfg = load_config(None, [])
    w = workload_from_config(cfg)
    plan = w.validate(dataclasses.replace(cfg.parallel, pp=2, ep=2, dp=2, microbatches=4,
                                          pp_schedule="interleaved_1f1b"), 4)
    pred = predict(w, plan, Hardware(), model_costs(w.build_model(), w), StateCache(w.build_model))
    first, second = pred.stages
    assert "expert_all_to_all" not in first.comm_bytes and second.comm_bytes["expert_all_to_all"] > 0
    assert second.model_state["params"]["gpu"] > first.model_state["params"]["gpu"]


def test_layout_word_for_selective_recomputation_and_its_memory_between_none_and_full(capsys):
    """--layout rc=layernorm+moe_act plans parallel.recompute=selective with those parts: a
    rank's activations fall below none's and stay above full's, the step FLOPs between them;
    the fit search offers the selective sets beside full recomputation."""
    import json
    from parallel.planner.check import one_changes
    cfg = ROOT / "configs" / "default.toml"
    preds = {}
    for word in ("", "rc=layernorm+moe_act", "rc"):
        assert main(["--config", str(cfg), "--world", "2", "--layout", f"dp2 ep2 {word}", "--json"]) == 0
        preds[word] = json.loads(capsys.readouterr().out)["layout"]
    sel = preds["rc=layernorm+moe_act"]
    assert sel["layout"]["recompute"] == "selective"
    assert sel["layout"]["recompute_modules"] == "layernorm,moe_act"
    act = {k: p["ranks"][0]["activation_bytes"] for k, p in preds.items()}
    assert act["rc"] < act["rc=layernorm+moe_act"] < act[""]
    step = {k: p["step_s"] for k, p in preds.items()}
    assert step[""] <= step["rc=layernorm+moe_act"] < step["rc"]
    from parallel.plan import ParallelPlan
    changes = [d for d, _ in one_changes(ParallelPlan(dp=2).validate(2))]
    assert "parallel.recompute=selective recompute_modules=layernorm,moe_act" in changes


@pytest.mark.parametrize("word, hint", [("zero1", "'z1'"), ("expert2", "'ep2'"), ("pipeline2", "'pp2'"),
                                        ("mbs_2", "'mbs2'"), ("1f1bb", "'1f1b'"), ("dualpipe", "'dualpipev'")])
def test_a_misspelt_layout_word_gets_one_line_with_a_suggestion(word, hint):
    """The planner's --layout words say what was meant, as train.py does for fields (issue 62)."""
    from parallel.plan import ParallelPlan
    from parallel.planner.check import parse_layout
    with pytest.raises(ValueError, match=rf"^--layout: '{word}' is not a layout word; did you mean {hint}\? "):
        parse_layout(f"dp2 {word}", ParallelPlan(), 8)
    with pytest.raises(ValueError) as err:
        parse_layout("dp2 foo", ParallelPlan(), 8)
    assert "did you mean" not in str(err.value)


def test_layout_shows_each_stage_step_by_part(capsys):
    """--layout on a preset: each stage's step split into parts that add up to it (GEMMs,
    memory-bound work, each exposed communication, the bubble), the part that weighs most
    on the slowest stage, and where each part's numbers come from (issue 61)."""
    cfg = ROOT / "configs" / "default.toml"
    assert main(["--config", str(cfg), "--world", "8", "--hw", "h100", "--layout",
                 "dp4 pp2 ep4 m4", "parallel.precision=bf16"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    stages = [ln for ln in lines if re.match(r"  stage \d+: ", ln)]
    assert len(stages) == 2, text
    for ln in stages:
        parts = dict(p.rsplit(" ", 1) for p in ln.split(": ", 1)[1].split(" = ")[0].split(", "))
        total = float(ln.rsplit(" = ", 1)[1])
        assert {"gemm", "memory_bound", "bubble", "expert_all_to_all"} <= set(parts), ln
        assert abs(sum(map(float, parts.values())) - total) <= 0.05 * len(parts) + 0.05, ln
    assert any(ln.startswith("  the largest part of the slowest stage: ") for ln in lines)
    assert "  bubble: the schedule's bubble fraction" in text
