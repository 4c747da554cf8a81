"""Benchmark: the expert all-to-all left exposed with parallel.a2a_overlap = none vs 1f1b
(parallel/interleave.py: the forward of micro-batch i+1 beside the backward of i).

Shapes: B sequences per rank, S tokens per sequence, D model dim, F expert d_ff, E experts,
K top-k, m micro-batches per step, P ranks (dp = ep = P, or with --pp 2 a pipeline of 2
stages over P ranks, dp = ep = P/2, the schedule pairing its forwards and backwards:
parallel/pipeline/paired_steps.py).

Each of P spawned processes (gloo on CPU, one compute thread; NCCL with one GPU per rank)
trains a small MoE GPT (every block an MoE block) for a few steps of m micro-batches, the
same work in both modes. Every expert all-to-all is issued asynchronously and waited for
through a Baton in both modes (under none nothing runs meanwhile, so a wait is all of the
exchange's time left after its issue; under 1f1b the other micro-batch computes first).
Per mode, median over the measured steps, slowest rank:
  step ms     wall time of the step (forward + backward + optimizer)
  waited ms   time blocked in the all-to-all waits: the exposed all-to-all
  exposed     waited / step
  handed      waits at which the other micro-batch ran first (1f1b only)
Gloo runs each collective on a thread of its own, so the overlap is real here; but the
gloo thread and the compute share 2 CPU cores, so read `waited`, not `step`. The planner's
rule for the lower bound (parallel/planner/step_time.py): 1f1b hides the share of the
expert all-to-all that runs inside a forward/backward pair (all but 1/m without a pipeline;
a pipeline rank's pairs / m v), as far as compute lasts. A pipeline runs DualPipe-V (the
1F1B family's pairs are refused: parallel/plan.py).

Run:  python bench/a2a_overlap.py          (P=2, m=4, S=128, D=256, F=512, E=8, K=2)
      python bench/a2a_overlap.py --pp 2 --world 4   (pp2 x dp2 x ep2, DualPipe-V, m=4)
      python bench/a2a_overlap.py --quick  (toy sizes, seconds)
"""
import argparse
import os

PIPELINE = "dualpipev"  # the schedule under --pp
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import build_model  # noqa: E402
from models.config import ModelConfig, MoEConfig  # noqa: E402
from moe.aux import collect_aux_loss, moe_layers  # noqa: E402
from parallel.apply import parallelize  # noqa: E402
from parallel.interleave import Baton, run_interleaved  # noqa: E402
from parallel.mesh import build_meshes  # noqa: E402
from parallel.plan import ParallelPlan  # noqa: E402
from parallel.planner.step_time import paired_shares  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402


def _model(cfg, dev):
    mc = ModelConfig(vocab_size=256, d_model=cfg["D"], n_layers=cfg["L"], n_heads=4,
                     d_ff=cfg["F"], max_seq_len=cfg["S"], tie_embeddings=cfg["pp"] == 1)
    moe = MoEConfig(num_experts=cfg["E"], top_k=cfg["K"], every=1)
    torch.manual_seed(0)
    return build_model(mc, moe, device=dev), mc, moe


def _worker(rank, world, cfg):
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    out = {}
    for mode in ("none", "1f1b"):
        model, mc, moe = _model(cfg, dev)
        pp, dp = cfg["pp"], world // cfg["pp"]
        plan = ParallelPlan(pp=pp, dp=dp, ep=dp, microbatches=cfg["m"] if pp > 1 else 0,
                            pp_schedule=PIPELINE if pp > 1 else "1f1b",
                            a2a_overlap=mode).validate(world, mc, moe)
        par = parallelize(model, plan, build_meshes(plan), loss_fn=_loss)
        baton = par.baton or Baton()  # none: the same waits, measured, nothing in between
        for _, layer in moe_layers(par.model):
            layer.set_a2a_waiter(baton.wait)
        opt = torch.optim.AdamW(par.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(rank)
        m, steps = cfg["m"], []
        for it in range(cfg["warmup"] + cfg["iters"]):
            tokens = torch.randint(0, mc.vocab_size, (cfg["B"], cfg["S"] + 1), generator=g).to(dev)
            xs, ys = tokens[:, :-1].chunk(m), tokens[:, 1:].chunk(m)

            def forward(i):
                return (_loss(par.model(xs[i]), ys[i]) + collect_aux_loss(par.model)) / m
            dist.barrier()
            baton.take()
            t0 = time.perf_counter()
            if pp > 1:  # the schedule runs the micro-batches (paired under 1f1b)
                par.pipeline_step(tokens[:, :-1], tokens[:, 1:])
            elif mode == "1f1b":
                par.set_grad_sync(False)
                run_interleaved(m, forward, lambda i, t: t.backward(), baton, lambda: par.set_grad_sync(True))
            else:
                for i in range(m):
                    par.set_grad_sync(i == m - 1)
                    forward(i).backward()
            if pp == 1:
                par.finish_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if it >= cfg["warmup"]:
                steps.append((time.perf_counter() - t0, baton.take()))
        out[mode] = dict(step=statistics.median(s for s, _ in steps),
                         waited=statistics.median(b["a2a_exposed_s"] for _, b in steps),
                         handed=steps[-1][1]["a2a_handed"], waits=steps[-1][1]["a2a_waits"])
    return out


def _loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="toy sizes, seconds")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1, help="pipeline ranks (DualPipe-V: two stages each)")
    args = ap.parse_args()
    cfg = dict(B=8, S=128, D=256, F=512, E=8, K=2, L=4, m=4, warmup=1, iters=4, pp=args.pp)
    if args.quick:
        cfg.update(S=32, D=64, F=128, iters=2)
    print(f"P={args.world} pp={args.pp} m={cfg['m']} micro-batches of {cfg['B'] // cfg['m']} x {cfg['S']} tokens, "
          f"D={cfg['D']} F={cfg['F']} E={cfg['E']} K={cfg['K']}, {cfg['L']} MoE blocks; median of "
          f"{cfg['iters']} steps (slowest rank)")
    results = run_distributed(_worker, args.world, cfg, timeout=1200)
    print(f"{'mode':<6} {'step ms':>8} {'waited ms':>10} {'exposed':>8} {'waits':>6} {'handed':>7}")
    base = None
    for mode in ("none", "1f1b"):
        step = max(r[mode]["step"] for r in results)
        waited = max(r[mode]["waited"] for r in results)
        base = base or waited
        print(f"{mode:<6} {step * 1e3:>8.1f} {waited * 1e3:>10.1f} {waited / step:>8.3f} "
              f"{results[0][mode]['waits']:>6} {results[0][mode]['handed']:>7}")
    w = max(r["1f1b"]["waited"] for r in results)
    plan = ParallelPlan(pp=args.pp, dp=args.world // args.pp, ep=args.world // args.pp,
                        microbatches=cfg["m"] if args.pp > 1 else 0,
                        pp_schedule=PIPELINE if args.pp > 1 else "1f1b",
                        a2a_overlap="1f1b")
    unpaired = [f"{1 - s:.2f}" for s in paired_shares(plan.validate(args.world), cfg["m"])]
    print(f"1f1b leaves {w / base:.2f} of the waited all-to-all time of none exposed "
          f"(planner's rule, the unpaired share per pipeline rank: {', '.join(unpaired)})")


if __name__ == "__main__":
    main()
