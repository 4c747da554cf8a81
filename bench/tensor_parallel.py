"""1-D vs 2-D vs 2.5-D tensor parallelism: what one rank holds and moves in one training step.

    python bench/tensor_parallel.py [--d-model 256] [--seq 256] [--batch 8] [--layers 2]

A dense GPT (no MoE: tensor parallelism alone; d_ff = 4 d_model, vocab 512, RoPE, untied) is
trained one step (forward, backward, clip, AdamW) under 1d tp=4 vs 2d tp=4 (2 x 2 grid) at
world 4, and 1d tp=8 vs 2.5d tp=8 (two stacked 2 x 2 grids) at world 8. Rank 0 reports:
  params      its local parameter bytes
  act blocks  bytes the transformer blocks saved for backward (autograd's saved tensors,
              each storage once): the activation memory tensor parallelism splits
  act total   the same for the whole forward (+ embedding, head, loss: every layout here
              gathers the logits on every tp rank, so this part does not shrink)
  payload     bytes handed to collectives by ledger kind (parallel/ledger.py), and the
              planner's formula for them (parallel/planner/comm.py: 1d _tensor, grid
              _grid_tensor), which must agree
  wire        the payload through ring algorithms on each group (all-gather (P-1) x the
              shard, reduce-scatter (P-1)/P x the input, all-reduce 2(P-1)/P, all-to-all
              (P-1)/P: parallel/planner/step_time.py): what crosses the links per rank
Formulas and measured figures: bench/README.md.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import build_model, init_weights  # noqa: E402
from models.config import ModelConfig, MoEConfig  # noqa: E402
from parallel.apply import parallelize  # noqa: E402
from parallel.dtensors import local  # noqa: E402
from parallel.mesh import build_meshes  # noqa: E402
from parallel.plan import ParallelPlan  # noqa: E402
from parallel.planner.step_time import _WIRE  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402

LAYOUTS = [(4, dict(tp=4)), (4, dict(tp=4, tp_mode="2d")),
           (8, dict(tp=8)), (8, dict(tp=8, tp_mode="2.5d", tp_depth=2))]


def _configs(args):
    model_cfg = ModelConfig(vocab_size=512, d_model=args.d_model, n_layers=args.layers, n_heads=8,
                            d_ff=4 * args.d_model, max_seq_len=args.seq, tie_embeddings=False)
    return model_cfg, MoEConfig(every=0)


class _SavedBytes:
    """Bytes autograd saves for backward, each storage once; `blocks` only while a
    transformer block runs (its forward pre/post hooks toggle `inside`)."""

    def __init__(self, model):
        self.seen, self.total, self.blocks, self.inside = set(), 0, 0, False
        for b in model.blocks:
            b.register_forward_pre_hook(lambda *_: setattr(self, "inside", True))
            b.register_forward_hook(lambda *_: setattr(self, "inside", False))

    def pack(self, t):
        held = local(t)  # 1d's DTensors: the local tensor they wrap
        key = held.untyped_storage().data_ptr()
        if key not in self.seen:
            self.seen.add(key)
            n = held.untyped_storage().nbytes()
            self.total += n
            self.blocks += n if self.inside else 0
        return t


def _step(rank, world, spec, args):
    model_cfg, moe_cfg = _configs(args)
    plan = ParallelPlan(**spec).validate(world, model_cfg, moe_cfg, args.batch, args.seq)
    par = parallelize(build_model(model_cfg, moe_cfg), plan, build_meshes(plan),
                      init_fn=lambda m: init_weights(m, 0, torch.device("cpu")))
    opt = par.prepare_optimizer(torch.optim.AdamW(par.model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model_cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    saved = _SavedBytes(par.model)
    with par.recording_comm():
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            logits = par.model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        par.clip_grad_norm_(1.0)
        opt.step()
    params = sum(local(p).numel() * local(p).element_size() for p in par.model.parameters())
    par.ledger.take()
    return dict(params=params, act_blocks=saved.blocks, act_total=saved.total,
                calls=par.ledger.take_calls())


def _predicted(world, spec, args) -> dict:
    """The planner's payload by kind for rank 0 (its formulas; parallel/planner/comm.py)."""
    from parallel.planner import Hardware, StateCache, predict
    from parallel.planner.flops import model_costs
    from parallel.planner.workload import Workload
    model_cfg, moe_cfg = _configs(args)
    w = Workload(lambda: build_model(model_cfg, moe_cfg), model_cfg, moe_cfg, args.batch,
                 {"decoder": args.seq})
    plan = w.validate(ParallelPlan(**spec), world)
    return predict(w, plan, Hardware(), model_costs(w.build_model(), w), StateCache(w.build_model)).rank0().comm_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    mb = 2 ** 20
    print(f"dense GPT d_model={args.d_model} d_ff={4 * args.d_model} layers={args.layers} vocab=512, "
          f"batch {args.batch} x {args.seq} tokens, fp32; rank 0, one step; MB = 2^20 bytes")
    print(f"{'layout':<18}{'params':>8}{'act blocks':>11}{'act total':>10}{'payload':>9}{'formula':>9}"
          f"{'wire':>8}  payload by kind (MB)")
    base = {}
    for world, spec in LAYOUTS:
        got = run_distributed(_step, world, spec, args, timeout=600)[0]
        pred = _predicted(world, spec, args)
        kinds = {}
        for (kind, coll, size), n in got["calls"].items():
            kinds[kind] = kinds.get(kind, 0) + n
        tp_kinds = {k: v for k, v in kinds.items() if k.startswith("tensor_parallel")}
        payload, formula = sum(tp_kinds.values()), sum(v for k, v in pred.items() if k.startswith("tensor_parallel"))
        wire = sum(n * _WIRE[coll](size) for (kind, coll, size), n in got["calls"].items()
                   if kind.startswith("tensor_parallel"))
        name = f"{spec.get('tp_mode', '1d')} tp={spec['tp']}" + (f" d={spec['tp_depth']}" if "tp_depth" in spec else "")
        row = dict(params=got["params"], act_blocks=got["act_blocks"], act_total=got["act_total"],
                   payload=payload, wire=wire)
        by_kind = ", ".join(f"{k.replace('tensor_parallel', 'tp')} {v / mb:.2f}" for k, v in sorted(tp_kinds.items()))
        print(f"{name:<18}{row['params'] / mb:>8.2f}{row['act_blocks'] / mb:>11.2f}{row['act_total'] / mb:>10.2f}"
              f"{payload / mb:>9.2f}{formula / mb:>9.2f}{wire / mb:>8.2f}  {by_kind}")
        if spec.get("tp_mode", "1d") == "1d":
            base = row
        else:
            print(f"{'  vs 1d':<18}" + "".join(f"{row[k] / base[k]:>{w}.2f}" for k, w in
                  (("params", 8), ("act_blocks", 11), ("act_total", 10), ("payload", 9))) + f"{'':>9}"
                  f"{row['wire'] / base['wire']:>8.2f}")
        assert abs(payload - formula) <= 0.01 * formula, (name, payload, formula)


if __name__ == "__main__":
    main()
