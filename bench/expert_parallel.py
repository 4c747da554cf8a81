"""Benchmark: expert-parallel all-to-all bytes and MoE-layer fwd+bwd time at world 1/2/4.

Shapes: T tokens (global), D model dim, F ffn dim, E experts, K top-k, P ranks.
For every world size the same global batch of T tokens is split over P spawned processes
(gloo on CPU, one thread each), one MoELayer with experts sharded over all P ranks.

  bytes   payload of one forward's two token all-to-alls (dispatch + combine, incl. the rows a
          rank keeps for itself) summed over ranks, counted by the communication ledger
          (parallel/ledger.py, less the [P, E] count tables), against the routed-token minimum
          2 * (kept assignments) * D * bytes/elem; dropless must print 1.00. For context
          the padded [E, C, D] layout of GShard-style dispatch at the same capacity factor
          (1.25 when dropless, where padding would also drop tokens).
  time    median wall time of fwd+bwd per iteration (slowest rank), ratio to world 1, and
          the CPU time of all ranks together (process_time, incl. gloo threads): the work
          done, which other jobs on a shared box distort less than wall time.

Run:  python bench/expert_parallel.py          (T=8192, D=256, F=1024, E=8, K=2)
      python bench/expert_parallel.py --quick  (toy size, seconds)
This machine has 2 cores: world 4 oversubscribes them, so expect no speed-up there; the
time column measures communication + routing overhead, not scaling. Read ratios only.
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe import MoELayer  # noqa: E402
from parallel.expert import apply_expert_parallel  # noqa: E402
from parallel.ledger import CommLedger  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _worker(rank, world, cfg):
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    torch.manual_seed(0)
    layer = MoELayer(cfg["D"], cfg["F"], cfg["E"], top_k=cfg["K"],
                     capacity_factor=cfg["cf"]).to(dev)
    if world > 1:
        apply_expert_parallel(layer, dist.group.WORLD)
    S = cfg["S"]
    n_seq = cfg["T"] // S // world
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(n_seq, S, cfg["D"], generator=g).to(dev).requires_grad_()
    times, cpu = [], []
    ledger = CommLedger({"ep": dist.group.WORLD})
    for it in range(cfg["warmup"] + cfg["iters"]):
        dist.barrier()
        _sync(dev)
        t0, c0 = time.perf_counter(), time.process_time()
        with ledger.recording():
            y = layer(x)
        fwd = ledger.take().get("expert_all_to_all", 0)
        y.square().mean().backward()
        _sync(dev)
        if it >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        layer.zero_grad(set_to_none=True)
        x.grad = None
    # the last forward: token rows, less the count table each dispatch exchanges first
    payload = fwd - world * cfg["E"] * 8 if world > 1 else 0
    L = cfg["E"] // world
    own = int(layer.last_stats.kept_E[rank * L:(rank + 1) * L].sum())  # rows kept on this rank,
    remote = payload - 2 * own * cfg["D"] * x.element_size() if world > 1 else 0  # out, back
    return {"times": times, "cpu": cpu, "payload": payload, "remote": remote,
            "kept": int(layer.last_stats.kept_E.sum()), "elem": x.element_size()}


def _row(cfg, world, outs):
    per_iter = [max(vals) for vals in zip(*(o["times"] for o in outs))]  # slowest rank
    kept = sum(o["kept"] for o in outs)
    payload = sum(o["payload"] for o in outs)
    minimum = 2 * kept * cfg["D"] * outs[0]["elem"]
    cpu_iter = [sum(vals) for vals in zip(*(o["cpu"] for o in outs))]  # all ranks' CPU
    return {"world": world, "time": statistics.median(per_iter),
            "cpu": statistics.median(cpu_iter), "payload": payload,
            "remote": sum(o["remote"] for o in outs), "minimum": minimum}


def _padded_bytes(cfg) -> int:
    """GShard-style: every rank sends E*C rows per direction, C = ceil(cf * S*K/E) per group."""
    cf = cfg["cf"] if cfg["cf"] is not None else 1.25
    groups = cfg["T"] // cfg["S"]
    C = math.ceil(cf * cfg["S"] * cfg["K"] / cfg["E"])
    return 2 * groups * cfg["E"] * C * cfg["D"] * 4


def run(cfg, worlds) -> None:
    print(f"T={cfg['T']} S={cfg['S']} D={cfg['D']} F={cfg['F']} E={cfg['E']} K={cfg['K']} "
          f"cf={cfg['cf']} iters={cfg['iters']} (fp32, gloo/cpu, 1 thread per rank)")
    print(f"{'world':>5} {'fwd+bwd ms':>11} {'vs w1':>6} {'cpu ms':>8} {'vs w1':>6} {'a2a MB':>8} {'remote MB':>9} "
          f"{'bytes/min':>9} {'padded/min':>10}")
    base = base_cpu = None
    for world in worlds:
        r = _row(cfg, world, run_distributed(_worker, world, cfg, timeout=900))
        base, base_cpu = base or r["time"], base_cpu or r["cpu"]
        ratio = r["payload"] / r["minimum"] if r["payload"] else float("nan")
        padded = _padded_bytes(cfg) / r["minimum"] if world > 1 else float("nan")
        print(f"{world:>5} {1e3 * r['time']:>11.1f} {r['time'] / base:>6.2f} "
              f"{1e3 * r['cpu']:>8.1f} {r['cpu'] / base_cpu:>6.2f} "
              f"{r['payload'] / 1e6:>8.2f} {r['remote'] / 1e6:>9.2f} {ratio:>9.2f} {padded:>10.2f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="toy size smoke run")
    ap.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes")
    args = ap.parse_args(argv)
    cfg = dict(T=8192, S=128, D=256, F=1024, E=8, K=2, cf=None, warmup=2, iters=6)
    if args.quick:
        cfg.update(T=512, S=32, D=32, F=64, warmup=1, iters=2)
    worlds = [int(w) for w in args.worlds.split(",")]
    for cf in (None, 1.0):
        run(dict(cfg, cf=cf), worlds)
        print()


if __name__ == "__main__":
    main()
