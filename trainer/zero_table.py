"""The ZeRO paper's Table 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020): per-device model-state memory of data parallelism with
mixed-precision Adam -- 2 bytes of fp16/bf16 parameters, 2 of gradients and K = 12 of fp32
master weights and moments per parameter -- for Psi parameters on Nd data-parallel devices:

  P_os        (ZeRO-1)  4 Psi + K Psi / Nd
  P_os+g      (ZeRO-2)  2 Psi + (2 + K) Psi / Nd
  P_os+g+p    (ZeRO-3)  (4 + K) Psi / Nd
  (Nd = 1: the baseline's (4 + K) Psi for all three)

paper_bytes gives those figures; planner_bytes reads the same per-device model state from the
planner (the tensors parallelize gives a meta model under parallel.param_dtype=bf16: bf16
parameters and gradients, fp32 master slices and Adam moments, FSDP2's fp32 shards under
ZeRO-3), for configs/models/zero_dense_{7_5b,128b,1t}.toml. tests/unit/test_zero_table.py
holds them equal; bench/zero_table.py prints the whole table.
"""
import dataclasses

K = 12
MODELS = {"7.5B": ("configs/models/zero_dense_7_5b.toml", 7.5e9),
          "128B": ("configs/models/zero_dense_128b.toml", 128e9),
          "1T": ("configs/models/zero_dense_1t.toml", 1e12)}
DEGREES = (1, 4, 16, 64, 256, 1024)


def paper_bytes(psi: float, nd: int, zero: int) -> float:
    """Table 1's per-device model-state bytes (ZeRO stage 1, 2 or 3)."""
    if zero == 1:
        return 4 * psi + K * psi / nd
    if zero == 2:
        return 2 * psi + (2 + K) * psi / nd
    return (4 + K) * psi / nd


def planner(config_path: str):
    """(workload, config, costs, cache) for planner_bytes: one read per layout, reused."""
    from parallel.planner import StateCache
    from parallel.planner.flops import model_costs
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    cfg = load_config(config_path, [])
    w = workload_from_config(cfg)
    return w, cfg, model_costs(w.build_model(), w), StateCache(w.build_model)


def planner_bytes(setup, nd: int, zero: int) -> int:
    """Rank 0's model-state bytes (parameters, gradients, optimizer state) as the planner
    predicts them for dp=Nd with this ZeRO stage."""
    from parallel.planner import Hardware, predict
    w, cfg, costs, cache = setup
    plan = w.validate(dataclasses.replace(cfg.parallel, zero=zero), nd)
    state = predict(w, plan, Hardware(), costs, cache).rank0().model_state
    return sum(sum(by_device.values()) for by_device in state.values())
