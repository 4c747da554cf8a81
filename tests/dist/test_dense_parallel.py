"""Layout equivalence: each parallel layout trains like one process (tiny MoE GPT, fp32).

Tolerance: losses and grad norms agree within 2e-5 absolute / 1e-4 relative over 5 AdamW
steps. The layouts change only the order of floating-point sums (all-reduces, split matmuls),
which perturbs fp32 values at ~1e-7 relative per step; Adam divides by sqrt(v), which can
amplify such differences to ~1e-5 in the weights after a few steps
(docs/torch_distributed_traps.md, trap 5), hence a bound two orders above the one-step noise
yet far below any real bug (a missing 1/dp or a dropped aux loss changes losses at the 1e-3
level or more). Several layouts share one spawn
because process start-up dominates the cost.
"""
import pytest

from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
ATOL, RTOL = 2e-5, 1e-4


def _worker(rank, world, layouts):
    out = {}
    for name, spec, cfg in layouts:
        model_cfg, moe_cfg = dc.configs(**cfg)
        out[name] = dc.train_layout(world, spec, model_cfg, moe_cfg)
    return out


def _run_and_check(world, layouts, timeout):
    refs = {}
    for _, _, cfg in layouts:
        key = tuple(sorted(cfg.items()))
        if key not in refs:
            refs[key] = dc.reference_run(*dc.configs(**cfg))
    results = run_distributed(_worker, world, layouts, timeout=timeout)
    for name, _, cfg in layouts:
        ref = refs[tuple(sorted(cfg.items()))]
        for rank_out in results:
            for step, ((l, g), (rl, rg)) in enumerate(zip(rank_out[name], ref)):
                assert abs(l - rl) <= ATOL + RTOL * abs(rl), f"{name} step {step}: loss {l} vs {rl}"
                assert abs(g - rg) <= ATOL + RTOL * abs(rg), f"{name} step {step}: grad norm {g} vs {rg}"


TIED, UNTIED = {}, {"tie": False}  # tied: first and last pipeline stage share the embedding
W2 = [("dp2", dict(dp=2), TIED),
      ("zero1_dp2", dict(dp=2, zero=1), TIED),
      ("zero2_dp2", dict(dp=2, zero=2), TIED),
      ("zero3_dp2", dict(dp=2, zero=3), TIED),
      ("ep2_dp2", dict(dp=2, ep=2), TIED),
      ("ep2_zero2_dp2", dict(dp=2, ep=2, zero=2), TIED),
      ("ep2_zero3_dp2", dict(dp=2, ep=2, zero=3), TIED),
      ("zero3_dp2_recompute", dict(dp=2, zero=3, recompute="full"), TIED),
      ("tp2", dict(tp=2), TIED),
      ("ep2_tp2", dict(tp=2, ep=2), TIED),           # experts over the tp pair (ep | dp*tp)
      ("pp2_1f1b", dict(pp=2, microbatches=2), UNTIED),
      ("pp2_gpipe", dict(pp=2, microbatches=2, pp_schedule="gpipe"), UNTIED),
      ("pp2_1f1b_tied", dict(pp=2, microbatches=2), TIED),
      # zero-bubble schedules (backward split into input and weight passes)
      ("pp2_zb_interleaved_tied", dict(pp=2, microbatches=2, pp_schedule="zb_interleaved"), TIED),
      ("pp2_zbv_recompute", dict(pp=2, microbatches=2, pp_schedule="zbv", recompute="full"), UNTIED),
      ("pp2_dualpipev", dict(pp=2, microbatches=4, pp_schedule="dualpipev"), UNTIED),
      # uneven stages balanced by parallel.pp_layers=auto (5 blocks over 2 stages)
      ("pp2_auto_layers_tied", dict(pp=2, microbatches=2, pp_layers="auto"), {"n_layers": 5})]

W4 = [("ep2_tp2_dp2", dict(tp=2, ep=2), TIED),
      ("ep2_tp2_zero3_dp2", dict(tp=2, ep=2, zero=3), TIED),
      ("ep4_tp2_zero2_dp2", dict(tp=2, ep=4, zero=2), TIED),
      ("tp2_zero1_dp2", dict(tp=2, zero=1), TIED),
      ("ep2_pp2_dp2", dict(pp=2, ep=2, microbatches=2), UNTIED),
      ("pp2_zero3_dp2", dict(pp=2, zero=3, microbatches=2), UNTIED),
      ("pp2_interleaved_tp2", dict(pp=2, tp=2, microbatches=2, pp_schedule="interleaved_1f1b"), UNTIED),
      ("ep2_pp2_dp2_zero2_tied", dict(pp=2, ep=2, zero=2, microbatches=2), TIED),
      ("pp2_zero3_dp2_tied", dict(pp=2, zero=3, microbatches=2), TIED),
      # zero-bubble schedules with experts over ep=2 inside the stages (8 layers for the
      # looped placement, so every rank holds MoE layers)
      ("zbv_ep2_dp2_zero1", dict(pp=2, ep=2, zero=1, microbatches=2, pp_schedule="zbv"), UNTIED),
      ("dualpipev_ep2_dp2", dict(pp=2, ep=2, microbatches=4, pp_schedule="dualpipev"), UNTIED),
      ("zb_interleaved_ep2_dp2_zero2_tied", dict(pp=2, ep=2, zero=2, microbatches=2,
                                                 pp_schedule="zb_interleaved"), {"n_layers": 8}),
      # stages without MoE layers under ep: interleaved on 4 blocks puts blocks 0 and 2 (both
      # dense) on pp rank 0; explicit uneven stages "1,4" leave stage 0 one dense block
      ("interleaved_ep2_dp2_dense_rank", dict(pp=2, ep=2, microbatches=4,
                                              pp_schedule="interleaved_1f1b"), UNTIED),
      ("pp2_layers_1_4_ep2_dp2_zero1", dict(pp=2, ep=2, zero=1, microbatches=2, pp_layers="1,4"),
       {"tie": False, "n_layers": 5})]

W8 = [("dp2_tp2_pp2_ep2_zero1", dict(dp=2, tp=2, pp=2, ep=2, zero=1, microbatches=2), UNTIED),
      ("dp2_tp2_pp2_ep2_zero1_tied", dict(dp=2, tp=2, pp=2, ep=2, zero=1, microbatches=2), TIED),
      # expert tensor parallelism composed: experts over ep x etp, their slices FSDP2-sharded
      # over edp = 8/(2*2) = 2, attention and the dense FFN over tp
      ("dp4_tp2_ep2_etp2_zero3", dict(dp=4, tp=2, ep=2, etp=2, zero=3), TIED),
      # 2-D tensor parallelism inside pipeline stages: a 2 x 2 grid per stage, experts over
      # ep=2 of its 4 ranks, the tied embedding's grid blocks shared by the end stages
      ("pp2_tp4_2d_ep2_tied", dict(pp=2, tp=4, tp_mode="2d", ep=2, microbatches=2), TIED)]


def test_world2_data_zero_expert_tensor_pipeline():
    _run_and_check(2, W2, timeout=300)


@pytest.mark.long
def test_world4_composed_layouts():
    _run_and_check(4, W4, timeout=400)


@pytest.mark.long
def test_world8_all_five():
    _run_and_check(8, W8, timeout=300)
