"""Expert tensor parallelism (parallel.etp): every expert's d_ff split over etp ranks.

At world 4, for each layout: the same weights and global batch as one process give
  outputs   the logits of this rank's share of the batch            within 2e-6 absolute
  gradients every parameter after one backward (after the layout's    within 1e-6 absolute +
            gradient sync), an expert's compared on this rank's block   1e-4 relative
            of it (ep block of experts, etp block of d_ff); not under
            ZeRO-2, whose sync leaves flat slices
  training  5 AdamW steps with global-norm clipping: loss and grad   the dense matrix's
            norm per step (tests/dist/dense_common.py)                  2e-5 / 1e-4
and the ledger books the d_ff-slice exchanges as expert_tensor_parallel. fp32 throughout:
the layouts only reorder sums (the n partial outputs of a row are added in rank order).
The loop and grouped_mm expert paths are both run.
"""
import pytest

from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
OUT_ATOL, GRAD_ATOL, GRAD_RTOL, ATOL, RTOL = 2e-6, 1e-6, 1e-4, 2e-5, 1e-4

LAYOUTS = [  # (name, ParallelPlan fields, experts_impl)
    ("dp4_ep2_etp2", dict(dp=4, ep=2, etp=2), "loop"),
    ("dp4_etp4", dict(dp=4, etp=4), "grouped_mm"),
    ("dp4_etp2_zero1", dict(dp=4, etp=2, zero=1), "loop"),
    ("dp4_etp2_zero2", dict(dp=4, etp=2, zero=2), "grouped_mm"),
    ("dp2_tp2_ep2_etp2", dict(dp=2, tp=2, ep=2, etp=2), "grouped_mm"),
]


def _configs(impl):
    model_cfg, moe_cfg = dc.configs()
    moe_cfg.experts_impl = impl
    return model_cfg, moe_cfg


def _worker(rank, world, layouts):
    return dc.check_layouts(world, layouts, _configs, GRAD_ATOL, GRAD_RTOL)


@pytest.mark.long
def test_expert_tensor_parallel_equals_one_process_world4():
    refs = {impl: dc.reference_run(*_configs(impl)) for impl in {i for _, _, i in LAYOUTS}}
    results = run_distributed(_worker, 4, LAYOUTS, timeout=400)
    for name, _, impl in LAYOUTS:
        for rank, rank_out in enumerate(results):
            (out_diff, grads, comm), losses = rank_out[name]
            etp_bytes = comm.get("expert_tensor_parallel", 0)
            assert out_diff <= OUT_ATOL, f"{name} rank {rank}: logits differ by {out_diff:.2e}"
            bad = [(n, f"{d:.2e} > {b:.2e}") for n, d, b in grads if d > b]
            assert not bad, f"{name} rank {rank}: gradients differ: {bad}"
            assert etp_bytes > 0, f"{name} rank {rank}: no expert_tensor_parallel bytes booked"
            for step, ((l, g), (rl, rg)) in enumerate(zip(losses, refs[impl])):
                assert abs(l - rl) <= ATOL + RTOL * abs(rl), f"{name} step {step}: loss {l} vs {rl}"
                assert abs(g - rg) <= ATOL + RTOL * abs(rg), f"{name} step {step}: norm {g} vs {rg}"
