"""Muon on pieces of matrices: owners chosen by work (parallel/muon.py) vs one owner for all.

    python bench/muon.py [--world 4] [--d-model 256] [--layers 4] [--experts 8] [--steps 3] [--zero 1]

A GPT-MoE under dp=world with ZeRO-1 (or --zero 3), stepped by MuonAdamW (Newton-Schulz in
fp32 on this CPU). Every Muon matrix is held in pieces (flat slices or FSDP2 shards), so each
step sends every piece to its matrix's owner and back. For both owner rules, per rank:
  ns_s      CPU seconds spent in the Newton-Schulz iterations of a step (thread CPU time, so
            the 2 shared cores' contention counts less than wall time would)
  work      the owned share of the Newton-Schulz work, E R C min(R, C) per matrix (the
            deterministic proxy: what the owner rule balances)
  bytes     what the rank hands to the two all_to_alls (ledger kind muon_orthogonalise) and
            what it receives
Prints the per-rank table and the ratios max / mean of NS time and received bytes: the step
waits for the busiest owner, so its NS time is the step's cost. Equal outputs are checked
(the owner rule changes who computes, not what).
"""
import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _single_owner(shapes, P):
    return [0] * len(shapes)


def _worker(rank, world, port, args, out_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from models import build_model, init_weights
    from models.config import ModelConfig, MoEConfig
    from moe.aux import collect_aux_loss
    from optim.build import muon_groups
    from optim.muon import MuonAdamW
    from parallel.apply import parallelize
    from parallel.mesh import build_meshes
    from parallel.muon import owners
    from parallel.plan import ParallelPlan
    D = args.d_model
    m = ModelConfig(vocab_size=256, d_model=D, n_layers=args.layers, n_heads=D // 64, d_ff=4 * D,
                    max_seq_len=64)
    e = MoEConfig(num_experts=args.experts, top_k=2, every=2)
    plan = ParallelPlan(dp=world, zero=args.zero).validate(world, m, e, 8 * world)
    results = {}
    for rule, assign in (("by work", owners), ("single owner", _single_owner)):
        model = init_weights(build_model(m, e, device="meta"), 0, torch.device("cpu"))
        par = parallelize(model, plan, build_meshes(plan), loss_fn=None)
        opt = par.prepare_optimizer(MuonAdamW(muon_groups(par.model, 0.1), 1e-3, ns_dtype="fp32"))
        opt.orthogonaliser.assign = assign
        spent = []
        inner = opt.orthogonaliser.__call__

        def timed_call(params, updates, ns, inner=inner, spent=spent):
            def timed_ns(u):
                t0 = time.thread_time()
                out = ns(u)
                spent[-1] += time.thread_time() - t0
                return out
            return inner(params, updates, timed_ns)
        opt.orthogonaliser = _Timed(opt.orthogonaliser, timed_call)
        g = torch.Generator().manual_seed(rank)
        for step in range(args.steps):
            x = torch.randint(0, 256, (8, 64), generator=g)
            spent.append(0.0)
            with par.recording_comm():
                (par.model(x).float().logsumexp(-1).mean() + collect_aux_loss(par.model)).backward()
                opt.step()
            comm = par.ledger.take()
            opt.zero_grad(set_to_none=True)
        pieces = list(opt.orthogonaliser.inner.pieces.values())
        own = assign([d.shape for d in pieces], world)
        from parallel.muon import ns_cost
        work = sum(ns_cost(d.shape) for d, o in zip(pieces, own) if o == rank) / sum(ns_cost(d.shape) for d in pieces)
        pads = [max(d.numels()) * 4 for d in pieces]
        received = world * sum(p for p, o in zip(pads, own) if o == rank) + sum(pads)
        results[rule] = dict(ns_s=min(spent[1:]) if len(spent) > 1 else spent[0], work=work,
                             sent=comm.get("muon_orthogonalise", 0), received=received,
                             first=next(par.model.parameters()).detach().clone(), matrices=len(pieces))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


class _Timed:
    """The orthogonaliser with its Newton-Schulz calls timed (shape() passed through)."""

    def __init__(self, inner, call):
        self.inner, self.call = inner, call

    def __call__(self, params, updates, ns):
        return self.call(params, updates, ns)

    def shape(self, p):
        return self.inner.shape(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--zero", type=int, default=1, choices=(1, 2, 3))
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(args.world, port, args, d), nprocs=args.world)
        res = [torch.load(Path(d) / f"rank{r}.pt") for r in range(args.world)]
    print(f"world {args.world}, dp={args.world} zero={args.zero}, D={args.d_model}, {args.layers} layers, "
          f"{args.experts} experts: {res[0]['by work']['matrices']} Muon matrices in pieces; "
          f"Newton-Schulz fp32, best of steps 2..{args.steps}")
    print(f"{'owners':<13} {'rank':>4} {'ns_s':>8} {'work':>6} {'sent MB':>8} {'recv MB':>8}")
    for rule in ("by work", "single owner"):
        for r, out in enumerate(res):
            x = out[rule]
            print(f"{rule:<13} {r:>4} {x['ns_s']:>8.3f} {x['work']:>6.2f} {x['sent'] / 1e6:>8.2f} "
                  f"{x['received'] / 1e6:>8.2f}")
    ratios = {}
    for rule in ("by work", "single owner"):
        ns = [out[rule]["ns_s"] for out in res]
        recv = [out[rule]["received"] for out in res]
        ratios[rule] = (max(ns), max(ns) / (sum(ns) / len(ns)), max(recv) / (sum(recv) / len(recv)))
        print(f"{rule}: busiest owner's NS {max(ns):.3f} s (max/mean {ratios[rule][1]:.2f}), "
              f"received bytes max/mean {ratios[rule][2]:.2f}")
    print(f"single owner / by work, busiest rank's NS time: {ratios['single owner'][0] / ratios['by work'][0]:.2f}x")
    same = all(torch.equal(out["by work"]["first"], out["single owner"]["first"]) for out in res)
    print(f"parameters after the steps equal under both rules: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
