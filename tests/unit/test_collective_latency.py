"""Collectives priced by message size (parallel/planner/hardware.py call_seconds, NCCL's ring
cost model) and the calls the planner counts for them (comm.py, step_time.comm_seconds)."""
import dataclasses

import pytest

from parallel.planner.hardware import call_seconds, preset, ring_steps

NVLINK = 370e9               # the h100 preset's intra-node bus bandwidth (bytes/s)


def test_one_call_is_the_fastest_protocol_of_the_hand_computed_model():
    """All-reduce of 1 MB on 8 ranks of one node: 14 ring steps, wire 2 x 7/8 x 1 MB.
    LL 6.6 + 14 x 0.6 us + wire / (bw / 4); LL128 14 + 14 x 1.9 + wire / (0.92 bw);
    Simple 8.4 + 14 x 3.4 + wire / bw: LL wins at 33.92 us on 370 GB/s."""
    wire = 2 * 7 / 8 * 1e6
    ll = 15.0e-6 + wire / (NVLINK / 4)
    ll128 = 40.6e-6 + wire / (NVLINK * 0.92)
    simple = 56.0e-6 + wire / NVLINK
    assert ll < ll128 < simple
    assert call_seconds("reduce", 8, 1, wire, NVLINK) == pytest.approx(ll, rel=1e-12)
    assert ll == pytest.approx(33.92e-6, rel=1e-3)


def test_steps_between_nodes_pay_the_network_latency():
    assert ring_steps("reduce", 16, 2) == (30, 4)
    assert ring_steps("gather", 16, 2) == (15, 1)
    assert ring_steps("a2a", 64, 8) == (1, 1) and ring_steps("a2a", 8, 1) == (1, 0)
    # a tiny all-to-all across nodes: LL, 6.6 + 2.7 us
    assert call_seconds("a2a", 16, 2, 8, 50e9) == pytest.approx(9.3e-6 + 8 / 12.5e9, rel=1e-12)


def test_bus_bandwidth_rises_with_message_size_like_an_nccl_tests_curve():
    """busbw = wire / time: far below the link at 1 KB, within 2% of it at 1 GB."""
    sizes = [2 ** k for k in range(10, 31, 2)]
    busbw = [s / call_seconds("reduce", 8, 1, s, NVLINK) for s in sizes]
    assert all(a < b for a, b in zip(busbw, busbw[1:]))
    assert busbw[0] < 0.05 * NVLINK and busbw[3] < 0.5 * NVLINK
    assert busbw[-1] > 0.98 * NVLINK


def _ep2_prediction(**over):
    from parallel.planner import Hardware, StateCache, predict
    from parallel.planner.comm import micro_count, step_comm
    from parallel.planner.flops import model_costs
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    cfg = load_config(None, ["train.micro_batch_size=2", *over.pop("cli", [])])
    w = workload_from_config(cfg)
    plan = w.validate(dataclasses.replace(cfg.parallel, dp=2, ep=2, **over), 2)
    cache = StateCache(w.build_model)
    _, events = step_comm(w, plan, cache.get(plan, 0), 8)
    hw = Hardware(tflops=1.0)
    return w, plan, events, micro_count(w, plan), predict(w, plan, hw, model_costs(w.build_model(), w), cache)


def test_the_expert_all_to_all_counts_its_calls_and_each_pays_its_latency():
    """Default config (2 MoE layers), dp2 x ep2, 4 micro-batches of 2 on a rank: a flat
    exchange makes 3 calls forward (counts, dispatch, combine) and 2 backward per layer and
    micro-batch; full recomputation 3 more. The seconds are the calls at call_seconds."""
    from parallel.planner.hardware import Hardware
    w, plan, events, m, pred = _ep2_prediction()
    (a2a,) = [e for e in events if e[0] == "expert_all_to_all"]
    moe_layers = sum(w.is_moe_block(i) for i in range(w.model_cfg.n_layers))
    assert moe_layers == 2 and m == 4
    assert a2a[5] == 5 * moe_layers * m
    wire = a2a[4] * (2 - 1) / 2
    hw = Hardware(tflops=1.0)
    per_call = call_seconds("a2a", 2, 1, wire / a2a[5], hw.intra_bw_gbs * 1e9)
    assert pred.rank0().comm_s["expert_all_to_all"] == pytest.approx(a2a[5] * per_call, rel=1e-12)
    # the latency part: what the bytes alone would take is less
    assert pred.rank0().comm_s["expert_all_to_all"] > wire / (hw.intra_bw_gbs * 1e9)
    _, _, again, _, _ = _ep2_prediction(recompute="full")
    (a2a_full,) = [e for e in again if e[0] == "expert_all_to_all"]
    assert a2a_full[5] == 8 * moe_layers * m


def test_every_event_of_a_tensor_and_pipeline_layout_carries_calls():
    from parallel.planner.comm import micro_count, step_comm
    from parallel.planner import StateCache
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    cfg = load_config(None, [])
    w = workload_from_config(cfg)
    plan = w.validate(dataclasses.replace(cfg.parallel, pp=2, tp=2, microbatches=4), 4)
    _, events = step_comm(w, plan, StateCache(w.build_model).get(plan, 0), 8)
    assert events and all(len(e) == 6 and e[5] >= 1 for e in events)
    (p2p,) = [e for e in events if e[1] == "p2p"]
    sends = plan.stages_per_rank * 2 - 1      # rank 0's chunks: the first stage sends no gradient
    assert p2p[5] == micro_count(w, plan) * sends
