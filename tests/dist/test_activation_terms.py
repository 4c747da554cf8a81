"""What a block keeps for backward under 1-D tensor parallelism, measured, against the planner's
per-token terms (parallel/planner/memory.py block_act_elems) -- issue 61's check of each term
layout by layout.

Measured: the bytes a forward leaves alive (trainer/memory.py's live-tensor counter, which
counts a DTensor op's result by its local tensor), for 4 blocks minus 2 blocks, over the
tokens this rank holds: the per-block holding of dense blocks and of MoE blocks (force-
balanced, dropless), one process and tp2 (gloo, sequence parallel), fp32 and under bf16
autocast (the blocks' weight casts taken off: the planner counts them apart). This CPU build's
RMSNorm is a composite that also keeps its fp32 normalized input (D per norm, two a block)
where CUDA's fused kernel keeps only the input and the reciprocal root: that is added to the
planner's count before comparing. Checked:
  - each case within 10% of the planner's count (measured 0.957-1.006);
  - tp2's ratio within 2% of one process's for the same block and precision (measured at
    most 1.3% apart): what tensor parallelism changes -- the gathered attention input and
    dense FFN input kept whole, tp D where the norm output counts D; under autocast one bf16
    copy of each for all its projections (moe/cast_once.py), not one per projection; the
    dense FFN's F shards through the fused activation -- is counted exactly. Before this
    check the counter missed every DTensor result (tp2 read 0.90 of one process), the planner
    the gathered inputs (tp2 dense 1.33x once counted) and each projection kept its own cast.
"""
import functools

import pytest
import torch

from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
B, S = 2, 64
CASES = {"dense": "moe.every=0", "moe": "moe.every=1"}


def _over(n_layers: int, case: str) -> list:
    return ["model.vocab_size=64", "model.d_model=64", f"model.n_layers={n_layers}", "model.n_heads=4",
            "model.d_ff=128", f"data.seq_len={S}", "model.activation=swiglu", "moe.num_experts=4",
            "moe.top_k=2", CASES[case], "moe.force_balance=true", f"train.batch_size={B}"]


def _held(rank, world, n_layers: int, case: str, bf16: bool, parts: str = "") -> tuple:
    """(bytes a forward leaves alive, bytes of the blocks' matmul weights' bf16 casts: under
    autocast the planner counts those apart, autocast_copy_bytes)."""
    import warnings

    from models import build_model, init_weights
    from parallel.apply import parallelize
    from parallel.dtensors import local
    from parallel.mesh import build_meshes
    from parallel.plan import ParallelPlan
    from trainer.config import load_config
    from trainer.memory import held_after
    warnings.filterwarnings("ignore", message=r"MoELayer\(force_balance=True\)")
    cfg = load_config(None, _over(n_layers, case))
    model = init_weights(build_model(cfg.model, cfg.moe, device="meta"), 0, torch.device("cpu"))
    if world > 1:
        rc = dict(recompute="selective", recompute_modules=parts) if parts not in ("", "none") else {}
        plan = ParallelPlan(tp=world, dp=1, **rc).validate(world, cfg.model, cfg.moe, B)
        model = parallelize(model, plan, build_meshes(plan), loss_fn=None).model
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(0))
    if parts and bf16:   # (the layernorm test's runs, parts "none" among them) as train.py runs it: the blocks under autocast, the routers in fp32
        from parallel.precision import apply_precision
        apply_precision(model, "bf16")
        bf16_around = False
    else:
        bf16_around = bf16

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_around):
            return model(tokens)
    held = held_after(forward)
    casts = sum(local(p).numel() * 2 for n, p in model.named_parameters()
                if bf16 and n.startswith("blocks.") and p.dim() >= 2)
    return held, casts


def _measured(tp: int, case: str, bf16: bool) -> float:
    """Bytes one block keeps per token on a rank (its weights' casts taken off)."""
    def held(n):
        if tp == 1:
            return _held(0, 1, n, case, bf16)
        return run_distributed(functools.partial(_held, n_layers=n, case=case, bf16=bf16), tp)[0]
    (h4, c4), (h2, c2) = held(4), held(2)
    return ((h4 - h2) - (c4 - c2)) / 2 / (B * S / tp)


def _counted(tp: int, case: str, bf16: bool) -> float:
    """The planner's bytes per token of the model's last block, plus what the CPU's composite
    RMSNorm keeps beside CUDA's (its fp32 normalized input, D per norm, in either precision)."""
    from parallel.planner.memory import block_act_elems
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    cfg = load_config(None, _over(4, case) + [f"parallel.tp={tp}", "parallel.dp=1"]
                      + (["parallel.precision=bf16"] if bf16 else []))
    w = workload_from_config(cfg)
    plan = w.validate(cfg.parallel, tp)
    return block_act_elems(w, 3, "decoder", plan) * (2 if bf16 else 4) + 2 * cfg.model.d_model * 4


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_blocks_holding_under_tp_is_the_planners(case, bf16):
    ratio = {tp: _measured(tp, case, bf16) / _counted(tp, case, bf16) for tp in (1, 2)}
    assert all(0.9 <= r <= 1.1 for r in ratio.values()), ratio
    assert abs(ratio[2] / ratio[1] - 1) <= 0.02, ratio


def _layernorm_freed(rank, world) -> dict:
    """{(case, bf16): bytes per token this rank's 4 blocks keep less with layernorm} (bf16 as
    train.py runs it, parallel/precision.py: the routers in fp32)."""
    return {(case, bf16): (_held(rank, world, 4, case, bf16, "none")[0]
                           - _held(rank, world, 4, case, bf16, "layernorm")[0]) / (B * S / world)
            for case in CASES for bf16 in (False, True)}


def test_layernorm_recompute_under_tp_frees_the_planners_count():
    """recompute_modules=layernorm under tp2 (sequence parallel): the attention's input is
    kept as the norm's input and gathered again in backward (parallel/output_recompute.py,
    Megatron's kept shard), so the gathered copy its projections keep -- tp D a token, the
    bf16 copy under autocast -- is freed; and the FFN norm's output where its readers keep it:
    in fp32 a dense FFN's gathered copy (tp D) or the MoE's shard (D), under bf16 the MoE
    router's fp32 input (D fp32). Measured exactly the planner's count (recompute_saved_elems),
    dense and MoE blocks, fp32 and bf16 (before, layernorm was refused under
    tp: the gathered copy was kept whatever the norm did)."""
    from parallel.planner.memory import recompute_saved_elems
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    measured = run_distributed(_layernorm_freed, 2)[0]
    for (case, bf16), got in measured.items():
        cfg = load_config(None, _over(4, case) + ["parallel.tp=2", "parallel.dp=1",
                                                  "parallel.recompute=selective",
                                                  "parallel.recompute_modules=layernorm"]
                          + (["parallel.precision=bf16"] if bf16 else []))
        w = workload_from_config(cfg)
        plan = w.validate(cfg.parallel, 2)
        counted = sum(recompute_saved_elems(w, i, plan) for i in range(4)) * (2 if bf16 else 4)
        assert got == counted, (case, bf16, got, counted)
