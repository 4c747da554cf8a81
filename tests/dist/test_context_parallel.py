"""Context parallelism (parallel.cp, parallel/context/): each sequence split over cp ranks.

For each layout, the same weights and global batch as one process (tiny MoE GPT, fp32, the
sequence-wise balance loss of the default config: its per-sequence statistics are summed
over the cp group) give
  outputs   the logits of this rank's rows and sequence part       within 2e-6 absolute
  gradients every parameter after one backward and the layout's   within 1e-6 absolute +
            gradient sync (experts on this rank's ep block)          1e-4 relative
  training  5 AdamW steps with global-norm clipping: loss and grad  2e-5 absolute + 1e-4
            norm per step (pipeline layouts: this check only, as in    relative
            test_dense_parallel.py: a stage alone has no logits)
and the ledger books the ring's send/recv or Ulysses' all-to-alls as context_parallel.
fp32 throughout: ring attention merges key blocks by log-sum-exp (other summation order),
the rest only reorders reductions.
"""
import pytest

from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
OUT_ATOL, GRAD_ATOL, GRAD_RTOL, ATOL, RTOL = 2e-6, 1e-6, 1e-4, 2e-5, 1e-4

W2 = [("cp2_ring", dict(cp=2), {}),
      ("cp2_ulysses", dict(cp=2, cp_mode="ulysses"), {}),
      ("cp2_ep2_folded", dict(cp=2, ep=2), {}),                  # experts over the cp pair
      ("cp2_ring_learned_positions_zero1", dict(cp=2, zero=1), {"positions": "learned"})]
W4 = [("cp2_tp2", dict(cp=2, tp=2), {}),
      ("cp2_pp2", dict(cp=2, pp=2, microbatches=2), {"tie": False}),
      ("cp2_pp2_gpipe", dict(cp=2, pp=2, microbatches=2, pp_schedule="gpipe"), {"tie": False}),
      # two stages per rank: the stage-0 shell embeds learned positions at global positions
      ("cp2_pp2_interleaved_learned", dict(cp=2, pp=2, microbatches=2, pp_schedule="interleaved_1f1b"),
       {"tie": False, "positions": "learned"}),
      ("cp2_dp2_zero3_ep2", dict(cp=2, dp=2, zero=3, ep=2), {}),
      ("cp4_ulysses_ep4_recompute", dict(cp=4, cp_mode="ulysses", ep=4, recompute="full"), {}),
      # experts over ep x etp with the all-to-all cut in 2 overlapped chunks, ZeRO-2 slices
      ("cp2_dp2_zero2_ep2_etp2_overlap", dict(cp=2, dp=2, zero=2, ep=2, etp=2),
       {"moe": {"a2a_overlap_degree": 2}})]
W8 = [("dp2_cp2_pp2_ep2_zero1", dict(dp=2, cp=2, pp=2, ep=2, zero=1, microbatches=2), {"tie": False})]


def _configs(variant):
    variant = dict(variant)
    moe_fields = variant.pop("moe", {})
    model_cfg, moe_cfg = dc.configs(**variant)
    for k, v in moe_fields.items():
        setattr(moe_cfg, k, v)
    return model_cfg, moe_cfg


def _worker(rank, world, layouts):
    out = {}
    for name, spec, variant in layouts:
        if spec.get("pp", 1) > 1:
            seen = {}
            losses = dc.train_layout(world, spec, *_configs(variant),
                                     inspect=lambda par, opt, step, comm: seen.setdefault("comm", comm))
            out[name] = ((0.0, [], seen["comm"]), losses)
        else:
            out.update(dc.check_layouts(world, [(name, spec, variant)], _configs, GRAD_ATOL, GRAD_RTOL))
    return out


def _check(world, layouts, timeout):
    refs = {}
    for _, _, v in layouts:
        key = repr(sorted(v.items()))
        if key not in refs:
            refs[key] = dc.reference_run(*_configs(v))
    results = run_distributed(_worker, world, layouts, timeout=timeout)
    for name, spec, v in layouts:
        key = repr(sorted(v.items()))
        for rank, rank_out in enumerate(results):
            (out_diff, grads, comm), losses = rank_out[name]
            dc.assert_same_as_one_process(name, rank, out_diff, grads, losses, refs[key],
                                          OUT_ATOL, ATOL, RTOL)
            assert comm.get("context_parallel", 0) > 0, f"{name} rank {rank}: no cp bytes: {comm}"
            if spec.get("ep", 1) > 1:  # a group shared with ep is not booked as cp traffic
                assert comm.get("expert_all_to_all", 0) > 0, f"{name} rank {rank}: {comm}"


def test_context_parallel_equals_one_process_world2():
    _check(2, W2, 300)


@pytest.mark.long
def test_context_parallel_equals_one_process_world4():
    _check(4, W4, 400)


@pytest.mark.long
def test_context_parallel_equals_one_process_world8():
    _check(8, W8, 400)
