"""Benchmark: how much of the expert-parallel all-to-all hides behind expert compute
(moe.a2a_overlap_degree = d), read from a per-rank timeline rather than wall-time gains.

Shapes: T tokens per rank, D model dim, F ffn dim, E experts, K top-k, P ranks.

Each of P spawned processes (gloo on CPU, one thread each; NCCL when one GPU per rank)
runs one MoELayer (experts sharded over all P ranks) forward+backward with a timeline
attached (moe/profiling/timeline.py): every all-to-all's issue and wait, every expert
chunk's compute. Per d it prints, over the measured iterations (slowest rank):
  step     median wall time of fwd+bwd
  blocked  time the host waited on all-to-alls (the exposed communication)
  exposed  blocked / step
  overlap  'yes' when the timeline shows every chunk c+1 dispatch in flight (issued, not yet
           waited) while chunk c's experts computed, and every combine c in flight during
           chunk c+1 (checked on every rank, every iteration; d = 1 has nothing to overlap)
2 shared CPU cores cannot turn hidden communication into a shorter step (the gloo threads
compete with compute for the same cores), so read `exposed`, not `step`.

GPU cost model (stated, not measured here): with a = one-way all-to-all time and c = expert
compute of the whole dispatch, the d = 1 layer costs 2a + c; with d chunks the exchange of
one chunk and the compute of another run on different engines (copy/NIC vs SMs), so
  T(d) ~ (2a + c) / d + (d - 1) / d * max(2a, c)
(the first dispatch and the last combine stay exposed), plus a fixed cost per extra
collective launch. The script fills a and c in from the d = 1 timeline and prints T(d).

Run:  python bench/chunked_a2a.py                (P=2 and 4, T=2048, D=256, F=1024, E=8, K=2)
      python bench/chunked_a2a.py --quick        (toy size, seconds)
      python bench/chunked_a2a.py --trace DIR    (also DIR/chunked_a2a_P{P}_d{d}_rank{r}.json,
                                                  Chrome/Perfetto traces of the last iteration)
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe import MoELayer  # noqa: E402
from moe.profiling.timeline import Timeline  # noqa: E402
from parallel.expert import apply_expert_parallel  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _overlapped(tl: Timeline, d: int) -> bool:
    if d == 1:
        return False
    pairs = [(f"dispatch {c + 1}", f"experts {c}") for c in range(d - 1)] + \
            [(f"combine {c}", f"experts {c + 1}") for c in range(d - 1)]
    return all(tl.in_flight_during(x, c) for x, c in pairs)


def _worker(rank, world, cfg):
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    out = {}
    for d in cfg["degrees"]:
        torch.manual_seed(0)
        layer = MoELayer(cfg["D"], cfg["F"], cfg["E"], top_k=cfg["K"], activation="swiglu",
                         a2a_overlap_degree=d).to(dev)
        apply_expert_parallel(layer, dist.group.WORLD)
        tl = Timeline()
        layer.set_timeline(tl)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(cfg["T"] // 16, 16, cfg["D"], generator=g).to(dev).requires_grad_()
        steps, blocked, ok, compute, waits = [], [], True, [], []
        for it in range(cfg["warmup"] + cfg["iters"]):
            tl.clear()
            dist.barrier()
            _sync(dev)
            t0 = time.perf_counter()
            layer(x).square().mean().backward()
            _sync(dev)
            dt = time.perf_counter() - t0
            if it >= cfg["warmup"]:
                steps.append(dt)
                blocked.append(tl.blocked_seconds())
                ok = ok and (d == 1 or _overlapped(tl, d))
                compute.append(sum(t1 - t0 for k, n, t0, t1 in tl.events
                                   if k == "compute" and n.startswith("experts")))
                waits.append(blocked[-1])
        if cfg["trace"]:
            os.makedirs(cfg["trace"], exist_ok=True)
            tl.save_chrome_trace(os.path.join(cfg["trace"], f"chunked_a2a_P{world}_d{d}_rank{rank}.json"), rank)
        out[d] = dict(step=statistics.median(steps), blocked=statistics.median(blocked), ok=ok,
                      compute=statistics.median(compute), waits=statistics.median(waits))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="toy sizes, seconds")
    ap.add_argument("--worlds", default="2,4", help="comma-separated ep sizes (default 2,4)")
    ap.add_argument("--degrees", default="1,2,4", help="a2a_overlap_degree values (default 1,2,4)")
    ap.add_argument("--trace", default="", help="directory for Chrome/Perfetto traces")
    args = ap.parse_args()
    cfg = dict(T=2048, D=256, F=1024, E=8, K=2, warmup=2, iters=5)
    if args.quick:
        cfg.update(T=256, D=32, F=64, warmup=1, iters=2)
    cfg.update(degrees=[int(d) for d in args.degrees.split(",")], trace=args.trace)
    print(f"T={cfg['T']}/rank D={cfg['D']} F={cfg['F']} E={cfg['E']} K={cfg['K']} swiglu, "
          f"fwd+bwd, median of {cfg['iters']} (slowest rank)")
    print(f"{'P':>2} {'d':>2} {'step ms':>8} {'blocked ms':>10} {'exposed':>8} {'overlap':>8} "
          f"{'GPU model T(d)/T(1)':>20}")
    for P in [int(p) for p in args.worlds.split(",")]:
        results = run_distributed(_worker, P, cfg, timeout=900)
        base = max(results, key=lambda r: r[1]["step"])[1]
        a = base["waits"] / 4   # d = 1: dispatch + combine, forward and backward
        c = base["compute"]
        t1 = 2 * a + c
        for d in cfg["degrees"]:
            worst = max(results, key=lambda r: r[d]["step"])[d]
            model = ((2 * a + c) / d + (d - 1) / d * max(2 * a, c)) / t1 if t1 > 0 else 1.0
            overlap = "n/a" if d == 1 else ("yes" if all(r[d]["ok"] for r in results) else "NO")
            print(f"{P:>2} {d:>2} {worst['step'] * 1e3:>8.1f} {worst['blocked'] * 1e3:>10.1f} "
                  f"{worst['blocked'] / worst['step']:>8.3f} {overlap:>8} {model:>20.2f}")
    if args.trace:
        print(f"traces in {args.trace}/ (open in https://ui.perfetto.dev or chrome://tracing)")


if __name__ == "__main__":
    main()
