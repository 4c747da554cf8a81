"""moe.gates_in_experts under the layouts whose dispatch carries the gates, against one process
that weighs the expert outputs in the combine (gates_in_experts=false: the reference maths).

At world 4, the tiny MoE GPT of tests/dist/dense_common.py with the gates applied inside the
experts, for each layout: the flat expert-parallel dispatch (the gates' own all-to-all), its
chunked overlap (a gate exchange per chunk), the hierarchical dispatch on 2 nodes of 2 (the
proxies forward the gates beside hop 2), hot-expert replicas (gates follow their rows to the
replica), expert tensor parallelism (the gates gathered beside the rows: each d_ff slice's
gate gradient summed by the gather's backward), capacity drops, and tensor x expert
parallelism. Checked, fp32, with the bounds of tests/dist/test_expert_tensor_parallel.py (the
layouts and the gates' placement only reorder sums and move one rounding):
  outputs    the logits of this rank's share of the batch       within 2e-6 absolute
  gradients  every parameter after one backward, experts on     within 1e-6 absolute +
             this rank's block                                   1e-4 relative
  training   5 AdamW steps: loss and grad norm per step          2e-5 + 1e-4 relative
One process with the gates inside equals one process without them to 1e-15 in fp64 (tests/
unit/test_gates_in_experts.py).
"""
import dataclasses

import pytest

from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
OUT_ATOL, GRAD_ATOL, GRAD_RTOL, ATOL, RTOL = 2e-6, 1e-6, 1e-4, 2e-5, 1e-4

LAYOUTS = [  # (name, ParallelPlan fields, MoE config changes beside gates_in_experts)
    ("dp4_ep4", dict(dp=4, ep=4), {}),
    ("dp4_ep4_chunks2", dict(dp=4, ep=4), {"a2a_overlap_degree": 2}),
    ("dp4_ep4_hierarchical", dict(dp=4, ep=4, gpus_per_node=2), {"dispatch": "hierarchical"}),
    ("dp4_ep4_replicas", dict(dp=4, ep=4), {"replica_slots": 1}),
    ("dp4_ep2_etp2", dict(dp=4, ep=2, etp=2), {}),
    ("dp4_ep4_capacity1", dict(dp=4, ep=4), {"capacity_factor": 1.0}),
    ("dp2_tp2_ep2", dict(dp=2, tp=2, ep=2), {}),
]


def _configs(changes: dict, gated: bool):
    model_cfg, moe_cfg = dc.configs()
    return model_cfg, dataclasses.replace(moe_cfg, gates_in_experts=gated, **changes)


def _worker(rank, world, layouts):
    out = {}
    for name, spec, changes in layouts:
        model_cfg, gated = _configs(changes, True)
        _, weighted = _configs(changes, False)
        out[name] = (dc.one_step_check(world, spec, model_cfg, gated, GRAD_ATOL, GRAD_RTOL, weighted),
                     dc.train_layout(world, spec, model_cfg, gated))
    return out


@pytest.mark.long
def test_gates_in_experts_equal_one_process_weighing_in_the_combine():
    refs = {name: dc.reference_run(*_configs(changes, False)) for name, _, changes in LAYOUTS}
    results = run_distributed(_worker, 4, LAYOUTS, timeout=600)
    for name, _, _ in LAYOUTS:
        for rank, rank_out in enumerate(results):
            (out_diff, grads, _), losses = rank_out[name]
            assert len(grads) > 0
            dc.assert_same_as_one_process(name, rank, out_diff, grads, losses, refs[name], OUT_ATOL,
                                          ATOL, RTOL)
