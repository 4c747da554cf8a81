"""The layout planner against measured runs: train.py on this machine, one launch per layout.

For each layout train.py runs 2 steps (launched a few at a time: tests/e2e/launch.py) of a tiny MoE GPT and writes rank 0's measurements to
metrics.jsonl; the planner predicts rank 0 of the same config and layout. Checked:
  model state (params, grads, optimizer bytes) within 2%  - measured on step 1, after the
      optimizer step (ZeRO-1 has then freed its full gradients: grads not compared there)
  communication bytes by ledger kind within 5%            - step 2 (step 1 of a pipeline
      also carries the schedule's one-time shape exchange)
  peak memory within 20%                                   - step 2 (log.peak_mem: a
      live-tensor counter on CPU, trainer/memory.py)
Routing is force-balanced (moe.force_balance) so the expert all-to-all has the planner's
stated imbalance of 1.0. The pipeline layouts print the predicted bubble next to the
measured step time (not asserted: a 2-core machine running 2-8 processes says little about
idle time).
"""
import json
from pathlib import Path

import pytest

from parallel.planner import Hardware, StateCache, predict
from trainer.planning import workload_from_config
from parallel.planner.flops import model_costs
from tests.e2e.launch import run_all

pytestmark = pytest.mark.e2e
TINY = ["model.d_model=32", "model.n_layers=4", "model.n_heads=2", "model.d_ff=64",
        "moe.num_experts=4", "moe.force_balance=true", "data.seq_len=32", "train.batch_size=8",
        "data.max_bytes=1000000", "train.eval_every=0", "log.moe_stats_every=0",
        "train.warmup_steps=2", "train.steps=2", "checkpoint.at_end=false",
        "log.tensorboard=false", "log.progress=none"]
SWITCH = ["model.arch=switch", "model.vocab_size=384", "model.n_layers=2"]  # + sentinel ids
MUON = ["train.optimizer=muon"]
FP8_DISPATCH = ["moe.dispatch_dtype=fp8"]
# moe.dispatch=hierarchical on 2 declared nodes of 2: force-balanced top-2 of 4 experts sends
# token t to experts 2t, 2t+1 (mod 4), one node, so the measured nodes per token is 1 (what
# `python -m trainer.profile ... --nodes 2` reports); the planner is given it (--nodes-per-token)
HIER = ["moe.dispatch=hierarchical"]
HIER_FP8 = HIER + ["moe.dispatch_dtype=fp8"]
MTP = ["model.mtp_depth=2"]  # two multi-token prediction depths (MoE blocks, their heads' logits)
GATES = ["moe.gates_in_experts=true"]  # the gates inside the experts: their own all-to-all, no
# combine outputs kept (moe/row_gates.py)
NODES_PER_TOKEN = {tuple(HIER): 1.0, tuple(HIER_FP8): 1.0}
LAYOUTS = [  # (world, parallel overrides[, other overrides]); plain dp and ep are inside the
    # zero-1 and composed layouts (same all-reduce and all-to-all terms), to keep the launches few
    (1, {}),
    (2, {"dp": 2, "zero": 1}),
    (2, {"dp": 2, "zero": 3}),
    (2, {"dp": 1, "tp": 2}),
    (2, {"dp": 1, "pp": 2, "microbatches": 4, "pp_schedule": "1f1b"}),
    # the published runs' forms (issue 61): pp2 with two virtual stages per rank at micro-batch 1
    # (interleaved 1F1B: 2(pp-1) + (v-1)pp + 1 = 5 chunks in flight on rank 0, Megatron's count),
    # and selective recomputation under tensor (sequence) parallelism
    (2, {"dp": 1, "pp": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2,
         "microbatches": 8}),
    (2, {"dp": 1, "tp": 2, "recompute": "selective", "recompute_modules": "layernorm,moe_act,experts,core_attn"}),
    # under bf16 autocast: the norms' fp32 outputs gathered (and their gradients reduce-scattered)
    # in fp32, the matmul outputs in bf16; layernorm's gather again in backward, fp32 too
    (2, {"dp": 1, "tp": 2, "recompute": "selective", "recompute_modules": "layernorm", "precision": "bf16"}),
    (4, {"dp": 2, "tp": 2, "ep": 2, "zero": 2}),
    (8, {"dp": 2, "tp": 2, "pp": 2, "ep": 2, "zero": 1, "microbatches": 2}),
    (2, {"dp": 2, "zero": 3, "recompute": "full"}, SWITCH),  # encoder-decoder, span corruption
    # selective recomputation: the norms' outputs, the experts' activations and hidden
    (2, {"dp": 2, "ep": 2, "recompute": "selective", "recompute_modules": "layernorm,moe_act,experts"}),
    # the ZeRO family: offload (host state) with ZeRO++ quantization, and hpZ at world 4
    (2, {"dp": 2, "zero": 3, "offload": "optimizer", "zeropp_quantize_weights": True,
         "zeropp_quantize_grads": True}),
    (2, {"dp": 2, "zero": 2, "offload": "optimizer", "zeropp_quantize_grads": True}),
    (4, {"dp": 4, "zero": 3, "zeropp_hpz": 2}),
    # expert tensor parallelism: each expert's d_ff over the 2 ranks (ZeRO-1 slices of it)
    (2, {"dp": 2, "etp": 2, "zero": 1}),
    # 2-D tensor parallelism on a 2 x 2 grid, and 2.5-D: two stacked grids (ZeRO-1 slices)
    (4, {"dp": 1, "tp": 4, "tp_mode": "2d"}),
    (8, {"dp": 1, "tp": 8, "tp_mode": "2.5d", "tp_depth": 2, "zero": 1}),
    # context parallelism: the ring with experts folded over the cp pair (ZeRO-1), and Ulysses
    # over cp=2 inside dp=2 with ZeRO-3
    (2, {"dp": 1, "cp": 2, "ep": 2, "zero": 1}),
    (4, {"dp": 2, "cp": 2, "cp_mode": "ulysses", "zero": 3}),
    # bf16 parameters and gradients with fp32 master slices (the ZeRO paper's K = 12)
    (2, {"dp": 2, "zero": 2, "precision": "bf16", "param_dtype": "bf16"}),
    # Muon: one momentum buffer per matrix element, its pieces to their owners and back
    # (ZeRO-1 slices of 1-D tensor-parallel blocks; the 2-D grid's blocks)
    (4, {"dp": 2, "tp": 2, "zero": 1}, MUON),
    (4, {"dp": 1, "tp": 4, "tp_mode": "2d"}, MUON),
    # the expert all-to-all's wire formats (moe.dispatch_dtype): auto under bf16 sends bf16
    # rows every way; fp8 sends e4m3 rows + a scale per 128 channels forward, bf16 the rest
    (2, {"dp": 2, "ep": 2, "precision": "bf16"}),
    (2, {"dp": 2, "ep": 2}, FP8_DISPATCH),
    # bytes inside and across declared nodes (comm_bytes_a2a_nodes against the planner's
    # expert_all_to_all_intra_node / _inter_node): the flat dispatch and the hierarchical one
    (4, {"dp": 4, "ep": 4, "gpus_per_node": 2}),
    (4, {"dp": 4, "ep": 4, "gpus_per_node": 2}, HIER),
    (4, {"dp": 4, "ep": 4, "gpus_per_node": 2}, HIER_FP8),
    # multi-token prediction: the depths' parameters, their expert all-to-alls, their blocks'
    # activations and logits (under tp: their norms' and projection's gradients summed; under
    # bf16 a depth's stream is eh_proj's bf16 output, gathered in bf16)
    (2, {"dp": 2, "ep": 2, "zero": 1}, MTP),
    (2, {"dp": 1, "tp": 2, "precision": "bf16"}, MTP),
    # the gates applied inside the experts under expert parallelism (flat dispatch)
    (2, {"dp": 2, "ep": 2}, GATES),
]
STATE_TOL, COMM_TOL, PEAK_TOL = 0.02, 0.05, 0.20


def _args(spec: dict, cache: Path, run_dir: Path, extra=()) -> list:
    return TINY + list(extra) + [f"parallel.{k}={json.dumps(v)}" for k, v in spec.items()] + \
        [f"data.cache_dir={cache}", f"run.dir={run_dir}"]


def _measure_all(jobs: list, tmp: Path) -> list:
    """metrics.jsonl records of each (world, args) launch: the first alone (it prepares the
    shared data cache), the rest concurrently (tests/e2e/launch.py: what is measured here is
    bytes and live tensors, not time)."""
    results = run_all(jobs[:1], tmp) + run_all(jobs[1:], tmp)
    out = []
    for (world, args), (code, log) in zip(jobs, results):
        assert code == 0, f"w{world} {args}:\n{log[-4000:]}"
        run_dir = Path(args[-1].split("=", 1)[1])
        out.append([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
    return out


def _predict(world: int, args: list, nodes_per_token: float = 0.0):
    from trainer.config import load_config
    cfg = load_config(None, args)
    w = workload_from_config(cfg, nodes_per_token=nodes_per_token)
    plan = w.validate(cfg.parallel, world)
    return predict(w, plan, Hardware(), model_costs(w.build_model(), w), StateCache(w.build_model))


def _total(by_device: dict) -> int:
    return sum(by_device.values())


def _close(pred: float, got: float, tol: float) -> bool:
    return abs(pred - got) <= tol * max(abs(got), 1)


@pytest.mark.long
def test_planner_predicts_measured_runs(tmp_path):
    cache = tmp_path / "data_cache"
    rows, failures = [], []
    jobs = [(world, _args(spec, cache, tmp_path / f"run{i}", *extra))
            for i, (world, spec, *extra) in enumerate(LAYOUTS)]
    measured = _measure_all(jobs, tmp_path)
    for (world, spec, *extra), (_, args), recs in zip(LAYOUTS, jobs, measured):
        name = f"w{world} " + ({tuple(SWITCH): "switch ", tuple(MUON): "muon ",
                                 tuple(FP8_DISPATCH): "fp8 dispatch ", tuple(HIER): "hierarchical ",
                                 tuple(HIER_FP8): "hierarchical fp8 ", tuple(MTP): "mtp2 ",
                                 tuple(GATES): "gates in experts "}[tuple(extra[0])]
                               if extra else "") + \
            (" ".join(f"{k}={v}" for k, v in spec.items()) or "single")
        pred = _predict(world, args, NODES_PER_TOKEN.get(tuple(extra[0]) if extra else (), 0.0))
        stage = pred.rank0()
        got_state = recs[0]["model_state_bytes"]
        for key in ("params", "grads", "optimizer"):
            if key == "grads" and spec.get("zero") == 1:
                continue  # freed by ZeRO-1's step before the metric is read
            p, g = _total(stage.model_state[key]), _total(got_state.get(key, {}))
            rows.append((name, f"state.{key}", p, g))
            if not _close(p, g, STATE_TOL):
                failures.append(rows[-1])
        got_comm = recs[1]["comm_bytes"]
        for kind in sorted(set(got_comm) | set(stage.comm_bytes)):
            p, g = stage.comm_bytes.get(kind, 0), got_comm.get(kind, 0)
            rows.append((name, f"comm.{kind}", p, g))
            if not _close(p, g, COMM_TOL):
                failures.append(rows[-1])
        split = recs[1].get("comm_bytes_a2a_nodes", {}).get("expert_all_to_all", {})
        for side in ("intra", "inter") if "gpus_per_node" in spec else ():
            p = stage.a2a_nodes.get(f"expert_all_to_all_{side}_node", 0)
            g = sum(split.get(f"{side}_node", {}).values())
            rows.append((name, f"comm.expert_all_to_all_{side}_node", p, g))
            if not _close(p, g, COMM_TOL):
                failures.append(rows[-1])
        # the peak is the device's; here the host is the device, so offloaded state adds to it
        host = sum(by_dev.get("cpu", 0) for by_dev in stage.model_state.values())
        p, g = stage.memory["peak"] + host, recs[1]["peak_mem_bytes"]
        rows.append((name, "peak_mem", p, g))
        if not _close(p, g, PEAK_TOL):  # every layout, none left out
            failures.append(rows[-1])
        if pred.plan.pp > 1:
            print(f"{name}: predicted bubble {pred.bubble:.2f} ({pred.plan.pp_schedule}, "
                  f"{pred.plan.microbatches} micro-batches); measured step 2 "
                  f"{recs[1]['step_time_s'] * 1e3:.0f} ms")
    print(f"\n{'layout':<48} {'quantity':<34} {'predicted':>11} {'measured':>11} {'ratio':>6}")
    for name, q, p, g in rows:
        print(f"{name:<48} {q:<34} {p:>11} {g:>11} {p / g if g else float('nan'):>6.3f}")
    assert not failures, f"predictions outside tolerance: {failures}"
