"""Measured pipeline idle time per stage against the planner's bubble fraction.

    python bench/pipeline_bubble.py [--pp 2] [--mbs 2 4 8] [--steps 5] [--d-model 256] [--schedules ...]

Each schedule (gpipe, 1f1b, interleaved_1f1b, zb_interleaved, zbv, dualpipev, 2bw) runs a dense
GPT (8 layers, MoE off) split over --pp processes (gloo, one thread each) for --steps timed
optimizer steps after 2 warm-up ones, at each micro-batch count (rows validate refuses, e.g.
fewer micro-batches than the schedule needs, are skipped). Idle fraction of a stage = 1 - (its process CPU time /
wall time) over the timed steps: with one thread per process and gloo's blocking waits, a
rank burns CPU only while it computes (or copies a message), so the rest is time spent
waiting for the neighbour stage (the bubble, plus message latency). Needs the cores to
itself: with other jobs running, waiting for a core looks like idle time too.
Predicted = parallel/pipeline/schedules.py: (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1), v=2;
zb_interleaved (p-1)/(3 v m+p-1), zbv and dualpipev 0 (at equal forward / input-backward /
weight-backward times); 2bw (p-1)/(3m+p-1), the per-step barrier (its loss all-reduce here).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import build_model, init_weights  # noqa: E402
from models.config import ModelConfig, MoEConfig  # noqa: E402
from parallel.apply import parallelize  # noqa: E402
from parallel.mesh import build_meshes  # noqa: E402
from parallel.pipeline.schedules import PP_SCHEDULES  # noqa: E402
from parallel.plan import ParallelPlan  # noqa: E402
from parallel.pipeline.schedules import bubble_fraction  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402

S, V = 128, 256
SCHEDULES = PP_SCHEDULES


def _loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _run(rank, world, schedule, m, steps, d_model):
    cfg = ModelConfig(vocab_size=V, d_model=d_model, n_layers=8, n_heads=4, d_ff=4 * d_model,
                      max_seq_len=S, tie_embeddings=False)
    moe = MoEConfig(every=0)
    plan = ParallelPlan(pp=world, pp_schedule=schedule, microbatches=m).validate(world, cfg, moe, 2 * m)
    par = parallelize(build_model(cfg, moe, device="meta"), plan, build_meshes(plan), loss_fn=_loss,
                      init_fn=lambda mod: init_weights(mod, 0, torch.device("cpu")))
    opt = torch.optim.AdamW(par.model.parameters(), lr=1e-4)
    x = torch.randint(0, V, (2 * m, S + 1), generator=torch.Generator().manual_seed(0))
    for step in range(2 + steps):
        if step == 2:
            wall, cpu = time.perf_counter(), time.process_time()
        par.pipeline_step(x[:, :-1], x[:, 1:])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return 1.0 - (time.process_time() - cpu) / (time.perf_counter() - wall)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--mbs", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    args = ap.parse_args()
    print(f"pp={args.pp}, dense GPT d_model={args.d_model} 8 layers, 2 sequences of {S} per "
          f"micro-batch, {args.steps} timed steps; idle = 1 - cpu/wall per stage")
    print(f"{'schedule':<18}{'m':>4}{'predicted':>11}" + "".join(f"{f'stage {s}':>10}" for s in range(args.pp))
          + f"{'mean':>8}")
    for schedule in args.schedules:
        for m in args.mbs:
            try:  # too few micro-batches for the schedule: validate says so, skip the row
                plan = ParallelPlan(pp=args.pp, pp_schedule=schedule, microbatches=m).validate(
                    args.pp, batch_size=2 * m)
            except ValueError:
                continue
            idle = run_distributed(_run, args.pp, schedule, m, args.steps, args.d_model, timeout=900)
            pred = bubble_fraction(schedule, args.pp, m, plan.stages_per_rank)
            print(f"{schedule:<18}{m:>4}{pred:>11.2f}" + "".join(f"{v:>10.2f}" for v in idle)
                  + f"{sum(idle) / len(idle):>8.2f}")


if __name__ == "__main__":
    main()
