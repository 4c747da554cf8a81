"""Benchmark: context parallelism (parallel.cp): per-rank activation memory against sequence
length, attention work per rank, bytes per step against the formula, and the longest
sequence that trains within a memory budget.

Shapes: S tokens per sequence, B = 1 sequence, D model dim, L layers, n = cp ranks.

For every S and cp in {1, 2, 4} (both modes for cp > 1), n spawned processes (gloo on CPU,
one thread each) build the same GPT (MoE in every other block, dropless, experts folded
over the cp ranks: ep = cp) and run one training forward + backward of one sequence, each
rank on its balanced chunks. Printed per rank 0:
  peak MB   the step's peak live tensor bytes beyond the model state (trainer/memory.py's
            counter on CPU: storages alive, the CUDA allocator's count on a GPU)
  vs cp1    that peak against cp=1's at the same S (the goal: about 1/cp)
  cp MB     bytes booked as context_parallel by the ledger, and the formula's
            (ring: (2(n-1) fwd + 4(n-1) + 2 bwd) blocks of B S/n D fp32 per layer;
             ulysses: 8 all-to-alls of B S/n D per layer; + the sequence balance loss'
             per-sequence statistics)
Then the attention work per rank (causal chunk pairs) of the balanced split against a
contiguous one, and, for a budget of cp=1's peak at the middle S, the longest S each cp
trains within it (from the measured points).

Run:  python bench/context_parallel.py                 (S = 1024 .. 8192, D=64, L=2)
      python bench/context_parallel.py --quick         (S = 256, 512: seconds)
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import build_model, init_weights  # noqa: E402
from models.config import ModelConfig, MoEConfig  # noqa: E402
from moe.aux import collect_aux_loss  # noqa: E402
from parallel.context.split import attention_work  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402


def _configs(S: int, D: int, L: int):
    m = ModelConfig(vocab_size=256, d_model=D, n_layers=L, n_heads=4, d_ff=4 * D, max_seq_len=S)
    return m, MoEConfig(num_experts=4, top_k=2, every=2)


def _worker(rank, world, S, D, L, mode):
    import torch.nn.functional as F

    from parallel.apply import parallelize
    from parallel.mesh import build_meshes
    from parallel.plan import ParallelPlan
    from trainer.memory import PeakMemory, model_state_bytes
    m, moe = _configs(S, D, L)
    plan = ParallelPlan(cp=world, cp_mode=mode, ep=world if world > 1 else 1).validate(world, m, moe, 1, S)
    meshes = build_meshes(plan) if world > 1 else None
    par = parallelize(init_weights(build_model(m, moe), 0, "cpu"), plan, meshes)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, S + 1), generator=g)
    x, y = par.split_sequence(tokens[:, :-1]), par.split_sequence(tokens[:, 1:])
    held = model_state_bytes(par.model, [], torch.optim.SGD(par.model.parameters(), lr=0.1))
    peak = PeakMemory(torch.device("cpu"), 0)
    with par.recording_comm(), peak:
        logits = par.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) + \
            collect_aux_loss(par.model)
        loss.backward()
    comm = par.ledger.take() if par.ledger is not None else {}
    return {"peak": peak.peak_bytes, "params": sum(held["params"].values()),
            "cp": comm.get("context_parallel", 0)}


def _formula(S: int, D: int, L: int, n: int, mode: str) -> int:
    if n == 1:
        return 0
    E = S // n * D
    moe_layers = L // 2
    stats = 1 * (4 + 1) * 4 * moe_layers
    if mode == "ring":
        return (2 * (n - 1) + 4 * (n - 1) + 2) * E * 4 * L + stats
    return 8 * E * 4 * L + stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="S = 256, 512 (seconds)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    seqs = [256, 512] if args.quick else args.seqs
    D, L = args.d_model, args.layers
    rows, peaks = [], {}
    print(f"GPT D={D} L={L} heads=4, MoE every other block (E=4, top-2, ep=cp), B=1; rank 0")
    print(f"{'S':>6} {'cp':>3} {'mode':<8} {'peak MB':>9} {'vs cp1':>7} {'cp MB':>8} {'formula':>8}")
    for S in seqs:
        for n in args.cps:
            for mode in (("ring",) if n == 1 else ("ring", "ulysses")):
                r = run_distributed(_worker, n, S, D, L, mode, timeout=900)[0]
                peaks[S, n, mode] = r["peak"]
                base = peaks[S, 1, "ring"]
                f = _formula(S, D, L, n, mode)
                print(f"{S:>6} {n:>3} {mode if n > 1 else '-':<8} {r['peak'] / 1e6:>9.1f} "
                      f"{r['peak'] / base:>7.3f} {r['cp'] / 1e6:>8.3f} {f / 1e6:>8.3f}", flush=True)
                rows.append((S, n, mode, r))
    print("\ncausal attention work per rank (chunk pairs), max/mean:")
    for n in (2, 4, 8):
        bal = [attention_work(n, r) for r in range(n)]
        con = [attention_work(n, r, balanced=False) for r in range(n)]
        print(f"  cp={n}: balanced {max(bal) / (sum(bal) / n):.2f}  contiguous "
              f"{max(con) / (sum(con) / n):.2f}")
    mid = seqs[len(seqs) // 2]
    budget = peaks[mid, 1, "ring"]
    print(f"\nlongest S within cp=1's peak at S={mid} ({budget / 1e6:.1f} MB), measured points:")
    for n in args.cps:
        for mode in (("ring",) if n == 1 else ("ring", "ulysses")):
            fit = [S for S in seqs if peaks[S, n, mode] <= budget]
            print(f"  cp={n} {mode if n > 1 else '':<8} {max(fit) if fit else '< ' + str(seqs[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
