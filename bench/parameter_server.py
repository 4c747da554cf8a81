"""Benchmark: the parameter server (parallel.ps_servers) against ring all-reduce, at W workers.

Shapes: W workers (= ranks), S server shards, P parameter bytes (fp32), E experts.

The default config's model (train.py's defaults: 4 blocks, 2 MoE layers of 8 experts,
top-2) on the embedded corpus, the global batch of 16 x 128 tokens split over W spawned
processes (gloo + torch.distributed.rpc over TensorPipe on loopback), S = 2 shards, AdamW.

  bytes   per step, measured by the client (worker) and the shards (server), against the
          formulas: ring all-reduce puts 2(W-1)/W x P on the wire per rank; a PS worker
          pushes <= P (gradients, untouched experts left home) and pulls P; shard s
          receives the W pushes of its units and sends W copies of them.
  sparse  expert bytes a dense push would send vs what the sparse push sent, on the routing
          of these batches (the default config at init: 8 experts, 4 x 128 tokens per worker)
          and on a 64-expert top-1 variant with 1 sequence per worker (where experts idle).
  slow    steps/s of the run (its slowest worker) with a stated straggler sleep of `--sleep`
          s per step, bulk-synchronous (staleness 0) vs bounded delay (staleness 2): the same
          worker slow every step (no consistency rule can beat it in the long run: staleness
          only lets the others run s steps ahead), and a different worker slow each step
          (transient stragglers: what bounded delay is for -- with s >= 1 the sleeps of
          different workers overlap instead of adding up).

Run:  python bench/parameter_server.py            (W=4, 6 steps per measurement)
      python bench/parameter_server.py --quick    (W=2, tiny model, seconds)
"""
import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.dist.harness import run_distributed  # noqa: E402

MB = 1e6


def _setup(cfg_over, quick):
    from trainer.config import load_config
    over = list(cfg_over)
    if quick:
        over += ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
                 "data.seq_len=32", "data.max_bytes=1000000"]
    return load_config(None, over)


def _batches(cfg, steps, world):
    from data.prepare import prepared_dir
    from data.sampler import open_split
    f = open_split(prepared_dir(cfg.data), "train", cfg.data.seq_len)
    B = cfg.train.batch_size
    return [torch.as_tensor(f.batch(list(range(s * B, (s + 1) * B)))).long() for s in range(steps)]


def _worker(rank, world, job):
    import models
    from moe.aux import collect_aux_loss
    from parallel.data_parallel import param_server
    from optim import build_optimizer
    cfg, batches, staleness, sleep, rotate, rpc_file = job
    model = models.init_weights(models.build_model(cfg.model, cfg.moe, device="meta"), 0, torch.device("cpu"))
    opt = build_optimizer(model, cfg.train)
    servers = min(2, world)
    client = param_server.start(model, opt, servers, staleness, rank, world, f"file://{rpc_file}")
    n = cfg.train.batch_size // world
    traffic, t0 = [], None
    for step, tokens in enumerate(batches, 1):
        if step == 2:
            t0 = time.perf_counter()     # step 1 warms up
        client.pull(step)
        if sleep and rank == (world - 1 if rotate is None else step % world):
            time.sleep(sleep)
        part = tokens[rank * n:(rank + 1) * n]
        model.zero_grad(set_to_none=True)
        logits = model(part[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), part[:, 1:].flatten())
        aux = collect_aux_loss(model)
        (loss + aux).backward()
        client.push(step, cfg.train.lr, loss, aux, cfg.train.grad_clip)
        traffic.append(client.take_traffic())
    dt = time.perf_counter() - t0
    torch.distributed.barrier()
    servers_io = client.server_traffic() if rank == 0 else None
    params = sum(p.numel() * 4 for p in model.parameters())
    param_server.stop(rank, servers)
    return dict(traffic=traffic, steps_per_s=(len(batches) - 1) / dt, server=servers_io, P=params)


def _run(cfg, batches, world, staleness=0, sleep=0.0, rotate=None):
    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(_worker, world, (cfg, batches, staleness, sleep, rotate,
                                                os.path.join(tmp, "rpc")), timeout=900)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--world", type=int, default=None, help="workers (default 4, quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="steps per measurement (default 6)")
    ap.add_argument("--sleep", type=float, default=None, help="the straggler's sleep per step, s (default 0.3)")
    args = ap.parse_args()
    W = args.world or (2 if args.quick else 4)
    steps = args.steps or (3 if args.quick else 6)
    sleep = args.sleep if args.sleep is not None else (0.05 if args.quick else 0.3)
    cfg = _setup([], args.quick)
    batches = _batches(cfg, steps, W)
    res = _run(cfg, batches, W)
    P = res[0]["P"]
    worker = {k: sum(t[k] for t in res[0]["traffic"]) / steps for k in res[0]["traffic"][0]}
    ring = 2 * (W - 1) / W * P
    print(f"W={W} workers, S={min(2, W)} shards, P={P / MB:.3f} MB of fp32 parameters, "
          f"{cfg.moe.num_experts} experts top-{cfg.moe.top_k}, {cfg.train.batch_size // W} x "
          f"{cfg.data.seq_len} tokens per worker")
    print("\nbytes per step (MB)                 measured   formula")
    print(f"ring all-reduce, wire per rank           -   {ring / MB:9.3f}   2(W-1)/W x P")
    print(f"PS worker push (sparse)          {worker['push'] / MB:9.3f}   <= {P / MB:.3f}  P minus idle experts")
    print(f"PS worker push (dense)           {worker['push_dense'] / MB:9.3f}   {P / MB:9.3f}   P")
    print(f"PS worker pull                   {worker['pull'] / MB:9.3f}   {P / MB:9.3f}   P")
    print(f"PS worker total / ring           {(worker['push'] + worker['pull']) / ring:9.2f}x  "
          f"{2 * P / ring:8.2f}x  2P / (2(W-1)/W P)")
    for s, (b_in, b_out) in enumerate(res[0]["server"]):
        print(f"PS shard {s}: in {b_in / steps / MB:.3f}, out {b_out / steps / MB:.3f} MB/step "
              f"(W x its units; all shards together: in ~ W x P = {W * P / MB:.3f}, out = W x P)")
    saved = 1 - worker["push_expert"] / max(worker["push_expert_dense"], 1)
    print(f"\nsparse push, default routing: expert bytes sent {worker['push_expert'] / MB:.3f} of "
          f"{worker['push_expert_dense'] / MB:.3f} MB per worker-step: {100 * saved:.1f}% saved")
    sparse_cfg = _setup(["moe.num_experts=64", "moe.top_k=1", f"train.batch_size={W}"], args.quick)
    sp = _run(sparse_cfg, _batches(sparse_cfg, steps, W), W)
    tr = [t for r in sp for t in r["traffic"]]
    sent, dense = sum(t["push_expert"] for t in tr), sum(t["push_expert_dense"] for t in tr)
    print(f"sparse push, 64 experts top-1, 1 x {cfg.data.seq_len} tokens per worker: "
          f"{100 * (1 - sent / dense):.1f}% of expert bytes saved")
    long = _batches(cfg, 3 * steps, W)
    print(f"\nstragglers, {len(long) - 1} timed steps, a stated sleep of {sleep} s per step:")
    for label, rotate in (("the same worker every step", None), ("a different worker each step", True)):
        base = None
        for s in (0, 2):
            r = _run(cfg, long, W, staleness=s, sleep=sleep, rotate=rotate)
            rate = min(x["steps_per_s"] for x in r)   # the run goes at its slowest worker's pace
            base = base or rate
            print(f"  {label:<30} ps_staleness={s}: {rate:6.2f} steps/s ({rate / base:.2f}x)")

if __name__ == "__main__":
    main()
