"""The planner under parallel.precision=fp8: the blocks' GEMMs at the preset's FP8 rate
(hardware.FP8_PEAKS x FP8_GEMM_EFFICIENCY), everything else at the bf16 rate, and one FP8
GEMM's transient copies in memory (memory.fp8_copy_bytes), against hand-computed values."""
import dataclasses

import pytest

from parallel.planner.hardware import preset


def _setup(over=(), world=1, **layout):
    from parallel.planner import StateCache
    from parallel.planner.flops import model_costs
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    cfg = load_config(None, list(over))
    w = workload_from_config(cfg)
    plan = w.validate(dataclasses.replace(cfg.parallel, **layout), world)
    return w, plan, model_costs(w.build_model(), w), StateCache(w.build_model)


def test_presets_fp8_rate_is_the_peak_times_deepgemms_share():
    """Each preset's FP8 rate against the cited figures, typed here (not the module's
    constants): DeepGEMM's 1350 TFLOP/s on Hopper's 1979 peak, that share of B200's 4500."""
    assert preset("h100").fp8_tflops == pytest.approx(1350.0)
    assert preset("h800").fp8_tflops == pytest.approx(1350.0)
    assert preset("b200").fp8_tflops == pytest.approx(4500 * 1350 / 1979)
    assert preset("a100").fp8_tflops == 0          # no FP8 tensor cores


def test_only_the_blocks_gemms_run_at_the_fp8_rate():
    """Default config, one process: timed FLOPs = 3 x tokens x (fp8_time x the blocks' GEMM
    FLOPs + their attention scores + the head's GEMM), by hand from the cost units."""
    from parallel.planner.flops import _self_attention_flops, rank_flops
    from parallel.planner.step_time import fp8_gemm_time
    w, plan, costs, cache = _setup(["parallel.precision=fp8"])
    h100 = preset("h100")
    r = fp8_gemm_time(plan, h100)
    assert r == pytest.approx(989 * 0.70 / 1350)
    tokens = w.batch_size * w.stream_tokens["decoder"]
    want = 0.0
    for (stream, block), u in costs.units.items():
        gemm = 2 * (u.dense_params + u.expert_params)
        want += (gemm * (r if block >= 0 else 1.0) + _self_attention_flops(costs, w, u)) * tokens
    state = cache.get(plan, 0)
    assert rank_flops(costs, w, plan, state, 1.0, r) == pytest.approx(3 * want, rel=1e-12)
    bf16 = dataclasses.replace(plan, precision="bf16")
    assert fp8_gemm_time(bf16, h100) == 1.0 and fp8_gemm_time(plan, preset("a100")) == 1.0


def test_fp8_prediction_is_faster_and_holds_one_gemms_copies():
    """The default model on one H100: FP8 shortens the step; its peak adds the widest GEMM's
    e4m3 + fp32 copies of weight [128, 512] and input [16 x 128 tokens, 512] plus scales, and
    holds autocast's bf16 weight copies for the GEMMs outside the blocks only (the head,
    [256, 128]: the vocabulary x d_model), where bf16 holds them for every GEMM."""
    from parallel.planner import predict
    from parallel.planner.memory import autocast_copy_bytes, fp8_copy_bytes
    h100 = preset("h100")
    w, fp8, costs, cache = _setup(["parallel.precision=fp8"])
    _, bf16, _, _ = _setup(["parallel.precision=bf16"])
    got, ref = predict(w, fp8, h100, costs, cache), predict(w, bf16, h100, costs, cache)
    assert got.step_s < ref.step_s
    weight, inputs = 128 * 512, 16 * 128 * 512
    want = int(5 * (weight + inputs) + 4 * (weight / 128 ** 2 + inputs / 128))
    assert fp8_copy_bytes(w, fp8) == want and fp8_copy_bytes(w, bf16) == 0
    state = cache.get(fp8, 0)
    head = 256 * 128 * 4  # fp32 bytes of the head's weight
    assert state.matmul_bytes[1] == head
    assert autocast_copy_bytes(state, fp8) == head // 2
    assert autocast_copy_bytes(state, bf16) == (state.matmul_bytes[0] + head) // 2
    assert got.rank0().memory["forward"] - ref.rank0().memory["forward"] == \
        want + head // 2 - autocast_copy_bytes(state, bf16)


def test_the_searchs_bounds_stay_below_fp8_predictions():
    """The search prunes by lower bounds; under precision=fp8 they price the GEMMs at the FP8
    rate too (the structure bound every FLOP), so on gshard's world-8 layouts each bound is at
    most the prediction it bounds (a bound above one could drop a layout from the top list)."""
    from parallel.planner import predict
    from parallel.planner.enumerate import variants
    from parallel.planner.flops import model_flops
    from parallel.planner.search import _stage_blocks, state_bytes, structure_bound, variant_bound
    from parallel.planner.step_time import fp8_gemm_time
    from parallel.planner import StateCache
    from parallel.planner.flops import model_costs
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    cfg = load_config("configs/gshard_gpt.toml", ["parallel.precision=fp8"])
    w = workload_from_config(cfg)
    costs, cache, hw = model_costs(w.build_model(), w), StateCache(w.build_model), preset("h100")
    sizes = state_bytes(w.build_model())
    checked = 0
    for layout in (dict(dp=8, ep=1), dict(dp=8, ep=4, zero=1), dict(pp=2, dp=4, ep=4, microbatches=4),
                   dict(dp=8, ep=4, etp=2, zero=2), dict(pp=4, dp=2, ep=2, microbatches=4)):
        plan = w.validate(dataclasses.replace(cfg.parallel, **layout), 8)
        pred = predict(w, plan, hw, costs, cache)
        assert variant_bound(w, plan, costs, hw, sizes, _stage_blocks(w, plan)) <= pred.step_s * (1 + 1e-9)
        s = {k: getattr(plan, k) for k in ("dp", "tp", "tp_mode", "tp_depth", "pp", "cp", "cp_mode", "ep", "etp")}
        compute_s = model_flops(costs, w, w.imbalance if s["ep"] > 1 else 1.0) * \
            fp8_gemm_time(plan, hw) / (hw.tflops * 1e12) / 8
        bound = structure_bound(w, cfg.parallel, s, hw, sizes, compute_s,
                                variants(s, (plan.zero,), ("none",), (False,), 8))
        assert bound <= pred.step_s * (1 + 1e-9)
        checked += 1
    assert checked == 5


@pytest.mark.parametrize("name", ["a100", "h100", "h200", "h800", "b200", "mi300x"])
def test_the_planner_prices_fp8_where_the_runtime_runs_its_kernels(name, monkeypatch):
    """One predicate (moe/fp8.py fp8_kernels): a preset's GEMMs are priced at the FP8 rate
    exactly where the runtime, on that GPU with deep_gemm installed, runs both FP8 kernels
    rather than the emulation -- the Linears' (parallel/fp8.py fp8_matmul_available) and the
    expert banks' grouped GEMM (moe/fp8.py grouped_fp8_kernel, which returns None before it
    needs a real GPU where the predicate says no)."""
    import torch

    import moe.fp8 as fp8
    from parallel.fp8 import fp8_matmul_available
    from parallel.planner.hardware import CAPABILITIES
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: CAPABILITIES[name])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fp8, "_deep_gemm_installed", lambda: True)
    cuda = torch.device("cuda")
    grouped = fp8.device_fp8_kernels(cuda).grouped
    assert (preset(name).fp8_tflops > 0) == (fp8_matmul_available(cuda) and grouped)
    if not grouped:   # past the predicate it would need torchao's kernels and a real GPU
        asked, ask = [], fp8.device_fp8_kernels
        monkeypatch.setattr(fp8, "device_fp8_kernels", lambda d: asked.append(d) or ask(d))
        assert fp8.grouped_fp8_kernel(cuda) is None and asked == [cuda]


def test_rowwise_prices_what_the_runtime_runs():
    """fp8_recipe=rowwise: the planner asks the runtime's cost model (moe/fp8_rowwise.py
    rowwise_pays) per GEMM: the Qwen3-30B-shaped model's GEMMs all stay bf16 (factor 1, the
    H200's measured 1.00x), Mixtral-8x22B-sized experts compiled run FP8 at the kernel's
    measured speed (forward and dgrad at 1.22x, wgrad bf16: at most (2/1.22 + 1)/3 = 0.88 of
    their bf16 time), and the blockwise recipe keeps the preset's DeepGEMM rate."""
    import dataclasses

    from parallel.planner.step_time import fp8_gemm_time
    from parallel.plan import ParallelPlan
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    hw = preset("h200")
    qwen = workload_from_config(load_config(None, [
        "model.d_model=2048", "model.n_layers=4", "model.n_heads=16", "model.n_kv_heads=4",
        "model.head_dim=128", "model.activation=swiglu", "moe.num_experts=64", "moe.top_k=8",
        "moe.d_ff=768", "moe.every=1", "data.seq_len=2048", "train.batch_size=8"]))
    rowwise = ParallelPlan(dp=1, precision="fp8", fp8_recipe="rowwise", compile=True)
    assert fp8_gemm_time(rowwise, hw, qwen) == 1.0
    mixtral = workload_from_config(load_config(None, [
        "model.d_model=6144", "model.n_layers=2", "model.n_heads=48", "model.n_kv_heads=8",
        "model.head_dim=128", "model.activation=swiglu", "moe.num_experts=8", "moe.top_k=2",
        "moe.d_ff=16384", "moe.every=1", "data.seq_len=4096", "train.batch_size=32",
        "model.max_seq_len=4096"]))
    factor = fp8_gemm_time(rowwise, hw, mixtral)
    assert (2 / 1.22 + 1) / 3 <= factor < 1.0, factor
    assert fp8_gemm_time(dataclasses.replace(rowwise, compile=False), hw, mixtral) == 1.0
    blockwise = ParallelPlan(dp=1, precision="fp8")
    assert fp8_gemm_time(blockwise, hw, qwen) == hw.tflops / hw.fp8_tflops
