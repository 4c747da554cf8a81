"""Bytes each rank hands to collectives in one training step, by kind, per layout.

    python bench/comm_ledger.py [--worlds 2 4] [--d-model 128]

One forward+backward+clip+AdamW step of an MoE GPT (4 layers, MoE every 2nd, 8 experts,
top-2, global batch 8 x 64 tokens) under each layout, counted by parallel/ledger.py at the
torch.distributed boundary (payload = the input buffer a rank hands over; see ledger.py).
Printed in MB for rank 0, with the total relative to plain data parallelism at that world.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import build_model, init_weights  # noqa: E402
from models.config import ModelConfig, MoEConfig  # noqa: E402
from moe.aux import collect_aux_loss  # noqa: E402
from parallel.apply import parallelize  # noqa: E402
from parallel.ledger import KINDS  # noqa: E402
from parallel.mesh import build_meshes  # noqa: E402
from parallel.plan import ParallelPlan  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402

B, S = 8, 64
LAYOUTS = {2: [dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3),
               dict(dp=2, ep=2), dict(tp=2), dict(pp=2)],
           4: [dict(dp=4), dict(dp=4, zero=3), dict(dp=4, ep=4), dict(dp=2, tp=2, ep=2),
               dict(dp=2, pp=2, ep=2), dict(tp=2, pp=2)]}


def _step(rank, world, spec, d_model):
    model_cfg = ModelConfig(vocab_size=512, d_model=d_model, n_layers=4, n_heads=4,
                            d_ff=4 * d_model, max_seq_len=S)
    moe_cfg = MoEConfig(num_experts=8, top_k=2, every=2)
    plan = ParallelPlan(**spec).validate(world, model_cfg, moe_cfg, B)
    par = parallelize(build_model(model_cfg, moe_cfg), plan, build_meshes(plan),
                      loss_fn=lambda lg, y: lg.float().logsumexp(-1).mean(),
                      init_fn=lambda m: init_weights(m, 0, torch.device("cpu")))
    opt = par.prepare_optimizer(torch.optim.AdamW(par.model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 512, (B, S), generator=g)
    n = B // plan.dp
    x = x[par.dp_rank * n:(par.dp_rank + 1) * n]
    with par.recording_comm():
        if par.pipeline is not None:
            par.pipeline_step(x, x)
        else:
            (par.model(x).float().logsumexp(-1).mean() + collect_aux_loss(par.model)).backward()
        par.clip_grad_norm_(1.0)
        opt.step()
    return par.ledger.take()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--d-model", type=int, default=128)
    args = ap.parse_args()
    mb = 2 ** 20
    short = {k: k.replace("zero_", "").replace("expert_", "").replace("_reduce_scatter", "_rs")
             for k in KINDS}
    w = max(len(v) for v in short.values()) + 2  # every header apart, however long
    print(f"{'W':>2} {'layout':<22}" + "".join(f"{short[k]:>{w}}" for k in KINDS) + f"{'total':>9}{'vs dp':>7}")
    for world in args.worlds:
        base = None
        for spec in LAYOUTS[world]:
            got = run_distributed(_step, world, spec, args.d_model, timeout=300)[0]
            total = sum(got.values())
            base = base or total
            name = " ".join(f"{k}{v}" for k, v in spec.items())
            print(f"{world:>2} {name:<22}" + "".join(f"{got.get(k, 0) / mb:>{w}.3f}" for k in KINDS)
                  + f"{total / mb:>9.3f}{total / base:>7.2f}")


if __name__ == "__main__":
    main()
