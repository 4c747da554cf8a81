"""2-D (parallel.tp_mode=2d) and 2.5-D (2.5d) tensor parallelism equal one process.

For each layout: the same weights and global batch as one process give
  outputs   the logits of this rank's dp share (every tp rank holds them)  within 2e-6 abs
  gradients every parameter after one backward and the gradient sync,      within 1e-6 abs +
            each rank's grid block of it (an expert's: its ep block)         1e-4 relative
  training  5 AdamW steps with global-norm clipping: loss and grad norm     2e-5 / 1e-4
            per step (tests/dist/dense_common.py)
and the ledger books the grid's collectives by kind (row, column and, under 2.5d, depth).
fp32 throughout: the grid only reorders sums (SUMMA's q partial products, the norms' q
partial statistics). The model has dense and MoE blocks, tied embeddings and RoPE; one
layout unties them, uses learned positions, LayerNorm and a shared expert (split over the
grid like the dense FFN).
"""
import pytest

from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
OUT_ATOL, GRAD_ATOL, GRAD_RTOL, ATOL, RTOL = 2e-6, 1e-6, 1e-4, 2e-5, 1e-4

W4 = [  # (name, ParallelPlan fields, model variant)
    ("tp4_2d", dict(dp=1, tp=4, tp_mode="2d"), "rope_tied"),
    ("tp4_2d_ep2", dict(dp=1, tp=4, tp_mode="2d", ep=2), "rope_tied"),
    ("tp4_2d_learned_layernorm", dict(dp=1, tp=4, tp_mode="2d", zero=1), "learned_untied"),
]
W8 = [
    ("tp8_2.5d", dict(dp=1, tp=8, tp_mode="2.5d", tp_depth=2), "rope_tied"),
    ("dp2_tp4_2d_ep4_zero2", dict(dp=2, tp=4, tp_mode="2d", ep=4, zero=2), "rope_tied"),
]
GRID_KINDS = ("tensor_parallel_row", "tensor_parallel_col")


def _configs(variant):
    if variant == "rope_tied":
        return dc.configs()
    model_cfg, moe_cfg = dc.configs(positions="learned", tie=False)
    model_cfg.norm = "layernorm"
    moe_cfg.num_shared_experts = 1  # split over the grid like the dense FFN
    return model_cfg, moe_cfg


def _worker(rank, world, layouts):
    return dc.check_layouts(world, layouts, _configs, GRAD_ATOL, GRAD_RTOL)


def _check(layouts, results, refs):
    for name, spec, variant in layouts:
        for rank, rank_out in enumerate(results):
            (out_diff, grads, comm), losses = rank_out[name]
            assert out_diff <= OUT_ATOL, f"{name} rank {rank}: logits differ by {out_diff:.2e}"
            bad = [(n, f"{d:.2e} > {b:.2e}") for n, d, b in grads if d > b]
            assert not bad, f"{name} rank {rank}: gradients differ: {bad}"
            kinds = GRID_KINDS + (("tensor_parallel_depth",) if spec["tp_mode"] == "2.5d" else ())
            missing = [k for k in kinds if not comm.get(k)]
            assert not missing, f"{name} rank {rank}: no bytes booked as {missing}: {comm}"
            for step, ((l, g), (rl, rg)) in enumerate(zip(losses, refs[variant])):
                assert abs(l - rl) <= ATOL + RTOL * abs(rl), f"{name} step {step}: loss {l} vs {rl}"
                assert abs(g - rg) <= ATOL + RTOL * abs(rg), f"{name} step {step}: norm {g} vs {rg}"


def _refs(layouts):
    return {v: dc.reference_run(*_configs(v)) for v in {v for _, _, v in layouts}}


@pytest.mark.long
def test_2d_tensor_parallel_equals_one_process_world4():
    _check(W4, run_distributed(_worker, 4, W4, timeout=400), _refs(W4))


@pytest.mark.long
def test_2d_and_2_5d_tensor_parallel_equal_one_process_world8():
    _check(W8, run_distributed(_worker, 8, W8, timeout=500), _refs(W8))
