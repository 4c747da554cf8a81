"""Benchmark: hot-expert replication (moe.replica_slots) under skewed routing, ep=2 and ep=4.

Shapes: T tokens per rank, D model dim, F ffn dim, E experts, K top-k, P ep ranks, R slots.

Routing is forced to a Zipf-like expert popularity: the router's logit bias (router_bias)
for the expert of popularity rank i (a fixed random permutation of the ids) is
zipf * log(1/(i+1)), on top of router logits of std ~1, so each token's top-k is a noisy
draw favouring the popular experts. For each P, one spawn of P gloo processes runs the same batches through
the same layer sharded with R = 0, 1, 2 (fwd + bwd, `steps` batches) and reports:

  max/mean   rows received by the busiest ep rank over the mean, per step, averaged over the
             steps (layer.last_stats.rank_imbalance; max/mean0: rank_imbalance_unreplicated,
             what the same step gives without replicas); the step waits for the busiest rank
  extra MB   bytes all ranks hand to collectives per step beyond R = 0, counted at the
             torch.distributed boundary by the communication ledger (parallel/ledger.py):
             replica weights fetched in forward + their gradients returned in backward
             (planned MB: the same from each step's placement, moe/placement.py: every
             replica costs its expert's bytes once forward and once backward)
  max|dy|    largest output difference against R = 0 (replication is the same function)

and a GPU cost model of the expert part of the step (no GPU here; 2 shared CPU cores cannot
show the gain in wall time): time = busiest-rank rows x per-row cost + busiest-rank replica
bytes / bandwidth, for a stated layer and device (MODEL below: Mixtral-8x7B-sized swiglu
experts in bf16 on H100-like GPUs), with rows and replica counts scaled from this run.

Run:  python bench/replication.py            (T=2048 tokens per rank, E=16, K=2, 4 steps)
      python bench/replication.py --quick    (toy size, seconds)
"""
import argparse
import copy
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe import MoELayer  # noqa: E402
from moe.placement import plan_placement  # noqa: E402
from parallel.expert import apply_expert_parallel  # noqa: E402
from parallel.ledger import CommLedger  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402

SLOTS = (0, 1, 2)
# Cost model constants (stated, not measured): an H100-like GPU at 400 TFLOP/s effective bf16
# for the expert GEMMs, 200 GB/s effective per-GPU NVLink all-to-all bandwidth, replica
# traffic not overlapped with compute (pessimistic); a Mixtral-8x7B-sized expert layer.
MODEL = dict(D=4096, F=14336, mats=3, bytes_per_elem=2, tokens_per_rank=8192, flops=400e12,
             bandwidth=200e9)


def _popularity_bias(E, zipf, seed=0):
    """Logit bias giving expert perm[i] popularity ~ (i+1)**-zipf."""
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(seed))
    bias = torch.empty(E)
    bias[perm] = -zipf * torch.log(torch.arange(1, E + 1, dtype=torch.float))
    return bias


def _replicas_sent(layer, R) -> int:
    """Expert-sized messages this rank sent in the last step: weights of its experts to the
    ranks holding replicas of them (forward) and the gradients of the replicas it held
    (backward), from the step's placement (the same global counts the dispatcher used)."""
    P, r = dist.get_world_size(), dist.get_rank()
    kept_E = layer.last_stats.kept_E.clone()
    dist.all_reduce(kept_E)
    replicas = plan_placement(kept_E.tolist(), P, R).replicas
    L = layer.num_experts // P
    owned = sum(1 for c in range(P) for e in replicas[c] if e // L == r)
    return owned + len(replicas[r])


def _run_one(layer, batches, ledger, R):
    imb, imb0, ys, ledger_bytes, sent = [], [], [], 0, 0
    for x in batches:
        layer.zero_grad(set_to_none=True)
        with ledger.recording():
            y = layer(x)
            (y.square().mean() + layer.aux_loss).backward()
        ledger_bytes += sum(ledger.take().values())
        imb.append(layer.last_stats.rank_imbalance)
        imb0.append(layer.last_stats.rank_imbalance_unreplicated)
        ys.append(y.detach())
        sent += _replicas_sent(layer, R)
    expert_bytes = sum(p[0].numel() * p.element_size() for p in layer.experts.weights()
                       if p is not None)
    return dict(imb=sum(imb) / len(imb), imb0=sum(imb0) / len(imb0), ys=ys, ledger=ledger_bytes,
                replica_sent=sent * expert_bytes, expert_bytes=expert_bytes)


def _worker(rank, P, cfg):
    torch.manual_seed(0)
    base = MoELayer(cfg["D"], cfg["F"], cfg["E"], top_k=cfg["K"], activation="swiglu",
                    init_std=1.0 / math.sqrt(cfg["D"]), router_bias=True)
    with torch.no_grad():
        base.router.bias.copy_(_popularity_bias(cfg["E"], cfg["zipf"]))
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(cfg["T"] // cfg["S"], cfg["S"], cfg["D"], generator=g)
               for _ in range(cfg["steps"])]
    ledger = CommLedger({"ep": dist.group.WORLD})
    out = {}
    for R in SLOTS:
        layer = copy.deepcopy(base)
        layer.replica_slots = R
        apply_expert_parallel(layer, dist.group.WORLD)
        out[R] = _run_one(layer, batches, ledger, R)
    ref = out[0]["ys"]
    for R in SLOTS:
        r = out[R]
        r["max_dy"] = max(float((a - b).abs().max()) for a, b in zip(r.pop("ys"), ref))
    return out


def _model_ms(max_over_mean, replicas_sent_max, K):
    """(expert GEMM ms, replica traffic ms) per step on the busiest rank for MODEL."""
    m = MODEL
    rows = max_over_mean * m["tokens_per_rank"] * K
    compute = rows * 6 * m["mats"] * m["D"] * m["F"] / m["flops"]
    comm = replicas_sent_max * m["mats"] * m["D"] * m["F"] * m["bytes_per_elem"] / m["bandwidth"]
    return 1e3 * compute, 1e3 * comm


def run(cfg, P) -> list:
    outs = run_distributed(_worker, P, cfg, timeout=600)
    r0 = outs[0]
    lines = []
    base_ledger = sum(o[0]["ledger"] for o in outs)
    base_ms = None
    for R in SLOTS:
        mm, mm0 = r0[R]["imb"], r0[R]["imb0"]
        extra = (sum(o[R]["ledger"] for o in outs) - base_ledger) / cfg["steps"]
        counted = sum(o[R]["replica_sent"] for o in outs) / cfg["steps"]
        # expert-equivalents sent by the busiest rank per step (weights fwd + grads bwd)
        eq = max(o[R]["replica_sent"] for o in outs) / cfg["steps"] / r0[R]["expert_bytes"]
        compute, comm = _model_ms(mm, eq, cfg["K"])
        base_ms = base_ms or compute + comm
        dy = max(o[R]["max_dy"] for o in outs)
        lines.append(f"{P:>3} {R:>3} {mm0:>10.2f} {mm:>9.2f} {extra / 1e6:>9.3f} {counted / 1e6:>10.3f} "
                     f"{eq:>8.2f} {compute:>9.1f} {comm:>8.1f} {(compute + comm) / base_ms:>7.2f} {dy:>8.1e}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="toy size smoke run")
    ap.add_argument("--eps", default="2,4", help="comma-separated expert-parallel sizes")
    ap.add_argument("--zipf", type=float, default=1.2, help="popularity exponent (default 1.2)")
    args = ap.parse_args(argv)
    cfg = dict(T=2048, S=128, D=64, F=128, E=16, K=2, steps=4, zipf=args.zipf)
    if args.quick:
        cfg.update(T=256, S=32, D=16, F=32, steps=1)
    m = MODEL
    print(f"skewed routing: E={cfg['E']} K={cfg['K']} zipf={cfg['zipf']}, T={cfg['T']} tokens per "
          f"rank, D={cfg['D']} F={cfg['F']} swiglu fp32, {cfg['steps']} steps (gloo/cpu)")
    print(f"cost model: D={m['D']} F={m['F']} swiglu bf16 experts, {m['tokens_per_rank']} tokens "
          f"per rank, {m['flops'] / 1e12:.0f} TFLOP/s, {m['bandwidth'] / 1e9:.0f} GB/s, replica "
          f"traffic not overlapped")
    print(f"{'ep':>3} {'R':>3} {'max/mean0':>10} {'max/mean':>9} {'extra MB':>9} {'planned MB':>10} "
          f"{'exp sent':>8} {'model ms':>9} {'+comm':>8} {'vs R=0':>7} {'max|dy|':>8}")
    for P in (int(p) for p in args.eps.split(",")):
        for line in run(cfg, P):
            print(line, flush=True)
    print("max/mean0: without replicas; extra MB: ledger bytes per step beyond R=0 (all ranks); "
          "planned MB: the same from each step's placement; exp sent: expert-sized messages the busiest rank "
          "sends per step; model ms: busiest-rank expert GEMMs, +comm: its replica traffic")


if __name__ == "__main__":
    main()
