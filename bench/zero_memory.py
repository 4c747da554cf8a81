"""Per-rank model-state memory (parameters + gradients + Adam state) for ZeRO 0/1/2/3.

    python bench/zero_memory.py [--worlds 2 4] [--d-model 256]

Measured on each rank after one training step of an MoE GPT (ep=1): bytes of the parameter
tensors it holds, of its gradients right after backward (ZeRO-2: the reduced slices), and
of its optimizer state after the step. Printed next to the ZeRO paper's accounting in fp32
(Psi parameters, N ranks; Adam keeps 2 fp32 moments): zero0 16Psi, zero1 4Psi+4Psi+8Psi/N,
zero2 4Psi+12Psi/N, zero3 16Psi/N (the mixed-precision version is 2+2+12 Psi). Ratio
measured/formula; slices are padded to N equal parts, so small tensors make it slightly > 1.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe.aux import collect_aux_loss  # noqa: E402
from models import build_model, init_weights  # noqa: E402
from models.config import ModelConfig, MoEConfig  # noqa: E402
from parallel.apply import parallelize  # noqa: E402
from parallel.dtensors import local  # noqa: E402
from parallel.mesh import build_meshes  # noqa: E402
from parallel.plan import ParallelPlan  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402


def _bytes(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


def _measure(rank, world, zero, d_model):
    model_cfg = ModelConfig(vocab_size=512, d_model=d_model, n_layers=4, n_heads=4, d_ff=4 * d_model)
    moe_cfg = MoEConfig(num_experts=4, top_k=2, every=2)
    model = init_weights(build_model(model_cfg, moe_cfg), 0, torch.device("cpu"))
    psi = sum(p.numel() for p in model.parameters())
    plan = ParallelPlan(zero=zero).validate(world, model_cfg, moe_cfg, 2 * world)
    par = parallelize(model, plan, build_meshes(plan))
    opt = par.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, 512, (2, 32))
    logits = model(x)
    (logits.float().logsumexp(-1).mean() + collect_aux_loss(model)).backward()
    params = _bytes(model.parameters())
    grads = _bytes(par.grads())  # what this rank holds: full grads, ZeRO-2 slices, shards
    opt.step()
    state = _bytes(v for st in opt.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.dim() > 0)
    return psi, params, grads, state


def formula(zero: int, psi: int, n: int) -> tuple:
    p, g, o = 4 * psi, 4 * psi, 8 * psi
    return {0: (p, g, o), 1: (p, g, o / n), 2: (p, g / n, o / n), 3: (p / n, g / n, o / n)}[zero]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--d-model", type=int, default=256)
    args = ap.parse_args()
    mb = 2 ** 20
    print(f"{'W':>2} {'zero':>4} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} "
          f"{'total MB':>9} {'formula MB':>10} {'ratio':>6} {'vs zero0':>8}")
    for world in args.worlds:
        base = None
        for zero in (0, 1, 2, 3):
            psi, p, g, o = run_distributed(_measure, world, zero, args.d_model, timeout=300)[0]
            total, expect = p + g + o, sum(formula(zero, psi, world))
            base = base or total
            print(f"{world:>2} {zero:>4} {p / mb:>10.2f} {g / mb:>9.2f} {o / mb:>9.2f} "
                  f"{total / mb:>9.2f} {expect / mb:>10.2f} {total / expect:>6.3f} {total / base:>8.3f}")


if __name__ == "__main__":
    main()
