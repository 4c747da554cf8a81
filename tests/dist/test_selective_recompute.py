"""parallel.recompute=selective under pp2 x dp2 x ep2 and tp2 x dp2 x ep2 (world 4): every
part, together, trains 5 AdamW steps to the same losses and gradient norms as the same
layout without recomputation, bit for bit (tolerance 0: the recomputed values are the
forward's own operations on the same inputs; under tp, layernorm gathers the attention's
input again in backward, the forward's own gather of the same recomputed shards). The layout
without recomputation equals one process (tests/dist/test_dense_parallel.py,
test_expert_parallel.py); the model has a shared expert so shared_experts has something to do.
"""
import functools

import pytest

from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist

ALL = "core_attn,layernorm,moe_act,mlp,shared_experts,experts"
LAYOUTS = [("pp2 dp2 ep2", {"pp": 2, "dp": 2, "ep": 2, "microbatches": 2}, ALL),
           ("tp2 dp2 ep2", {"tp": 2, "dp": 2, "ep": 2}, ALL)]


def _worker(rank, world, layouts):
    rows = []
    for name, spec, parts in layouts:
        model_cfg, moe_cfg = dc.configs()
        moe_cfg.num_shared_experts = 1
        plain = dc.train_layout(world, spec, model_cfg, moe_cfg)
        sel = dc.train_layout(world, {**spec, "recompute": "selective", "recompute_modules": parts},
                              model_cfg, moe_cfg)
        rows += [(name, step, abs(a[0] - b[0]) + abs(a[1] - b[1])) for step, (a, b) in enumerate(zip(plain, sel))]
    return rows


def test_selective_recompute_equals_none_under_pp_and_tp():
    results = run_distributed(functools.partial(_worker, layouts=LAYOUTS), 4, timeout=400)
    bad = [f"rank {r}: {name} step {s}: {d:.3g}" for r, rows in enumerate(results) for name, s, d in rows if d != 0]
    assert not bad, "\n".join(bad)
    assert all(len(rows) == len(LAYOUTS) * dc.STEPS for rows in results)
