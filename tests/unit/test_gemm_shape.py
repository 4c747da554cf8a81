"""The planner's GEMM time by shape (parallel/planner/hardware.py gemm_efficiency) and the
expert GEMMs priced at their per-expert shape (step_time.expert_gemm_slowdown)."""
import dataclasses
import math

import pytest

from parallel.planner.hardware import (GEMM_EFFICIENCY, GEMM_MEASURED, Hardware,
                                       gemm_efficiency, preset)


def test_the_rule_returns_each_measured_point_and_interpolates_in_log_flops():
    for m, k, n, share in GEMM_MEASURED:
        if (m, k, n) not in ((8192, 4096, 14336), (8192, 14336, 4096)):  # equal FLOPs: averaged
            assert gemm_efficiency(m, k, n) == pytest.approx(share, abs=1e-12)
    mixtral = (0.755 + 0.727) / 2
    assert gemm_efficiency(8192, 4096, 14336) == pytest.approx(mixtral, abs=1e-12)
    # halfway in log10(FLOPs) between DeepSeek's expert GEMM (0.563) and the Mixtral pair
    lo, hi = math.log10(2 * 4096 * 7168 * 2048), math.log10(2 * 8192 * 4096 * 14336)
    m = 10 ** ((lo + hi) / 2) / (2 * 4096 * 4096)
    assert gemm_efficiency(m, 4096, 4096) == pytest.approx((0.563 + mixtral) / 2, abs=1e-9)
    # outside the points: the nearest end's share (no extrapolation)
    assert gemm_efficiency(64, 64, 64) == pytest.approx(0.563)
    assert gemm_efficiency(65536, 65536, 65536) == pytest.approx(0.738)


def test_the_memory_roofline_caps_small_gemms_where_the_hardware_says_how_fast_hbm_is():
    h100 = preset("h100")
    m, k, n = 16, 2048, 768                       # a decode-sized expert GEMM
    at_peak = 2 * m * k * n / (989e12)
    hbm = 2 * (m * k + k * n + m * n) / 3.35e12
    assert gemm_efficiency(m, k, n, h100) == pytest.approx(at_peak / max(at_peak / 0.563, hbm))
    assert gemm_efficiency(m, k, n, h100) < 0.1 < gemm_efficiency(m, k, n)  # HBM-bound
    assert gemm_efficiency(8192, 8192, 8192, h100) == pytest.approx(0.770)  # compute-bound


def _qwen3_30b(hw, **layout):
    from parallel.planner import StateCache, predict
    from parallel.planner.flops import model_costs, rank_flops
    from parallel.planner.step_time import expert_gemm_slowdown, expert_rows
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    cfg = load_config("configs/models/qwen3_30b_a3b.toml",
                      ["train.batch_size=1024", "train.micro_batch_size=1", "parallel.precision=bf16"])
    w = workload_from_config(cfg)
    plan = w.validate(dataclasses.replace(cfg.parallel, dp=-1, **layout), 16)
    costs = model_costs(w.build_model(), w)
    pred = predict(w, plan, hw, costs, StateCache(w.build_model))
    return w, plan, costs, pred, expert_rows(w, plan), expert_gemm_slowdown(w, plan, hw), rank_flops


def test_small_experts_take_longer_than_the_preset_rate_and_only_their_flops_stretch():
    """Qwen3-30B-A3B on 16 H100 at EP16: a local expert gets 4096 tokens x 8 x 16 / 128 = 4096
    rows a micro-batch, GEMMs [4096, 2048] x [2048, 768] (and back): 1.3e10 FLOPs, below the
    smallest measured point (0.563), so each runs 0.70 / 0.563 times the preset's time."""
    h100 = preset("h100")
    w, plan, costs, pred, rows, slow, rank_flops = _qwen3_30b(h100, ep=16, zero=1)
    assert rows == 4096
    assert slow == pytest.approx(GEMM_EFFICIENCY / 0.563)
    state = pred.rank0()
    base, timed = rank_flops(costs, w, plan, state), rank_flops(costs, w, plan, state, slow)
    expert = rank_flops(costs, w, plan, state, 2.0) - base          # the expert GEMMs' FLOPs
    assert timed == pytest.approx(base + (slow - 1) * expert)
    assert 0 < expert < base
    assert state.flops == base                                          # FLOPs stay FLOPs
    plain = dataclasses.replace(h100, peak_tflops=0.0)                  # no peak: no shape rule
    _, _, _, unpriced, _, slow0, _ = _qwen3_30b(plain, ep=16, zero=1)
    assert slow0 == 1.0
    t = 1e-12 / h100.tflops
    assert pred.step_s - unpriced.step_s == pytest.approx((timed - base) * t, rel=1e-6)


def test_hardware_without_a_peak_prices_every_gemm_at_its_rate():
    assert Hardware().peak_tflops == 0 and Hardware().hbm_tbs == 0


def test_layout_check_states_the_async_save_staging(capsys):
    """--layout prints what checkpoint.async stages in host memory per rank (parameters and
    optimizer state: planner/memory.py async_save_host_bytes) and --json gives it per rank."""
    import json

    from commands.plan import main
    args = ["--config", "configs/gshard_gpt.toml", "--world", "16", "--hw", "h100",
            "--layout", "pp2 ep8 z1 m4"]
    assert main(args) == 0
    assert "checkpoint save: each rank writes its own slices and shards (nothing gathered" in \
        capsys.readouterr().out
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for r in out["layout"]["ranks"]:
        st = r["model_state_bytes"]
        assert r["async_save_host_bytes"] == sum(st["params"].values()) + sum(st["optimizer"].values()) > 0
