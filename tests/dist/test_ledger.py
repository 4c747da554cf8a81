"""Communication ledger (parallel/ledger.py) against hand-computed volumes, 2 gloo processes.

Tiny MoE GPT (tests/dist/dense_common.py), one forward+backward+clip per layout; bytes are
the payload each rank hands to its collectives (see ledger.py), so every number is exact:
  dp=2:        all-reduce of every gradient (fp32) once; the norm reduction (4 bytes) is "other"
  dp=2 ep=2:   dense + router gradients all-reduced (experts have no copy to sync: edp=1);
               all-to-all per MoE layer: count tables (P*E int64: every rank's [E] counts
               to every rank, for the replica placement) plus the routed rows
               (T*K rows of D floats) out and back in forward, and again in backward
  zero=3 dp=2: FSDP2 all-gathers each unit's padded shard (forward, and again in backward
               for units resharded after forward) and reduce-scatters its padded gradients
"""
import math

import pytest
import torch
import torch.distributed as dist

from parallel.apply import parallelize
from parallel.mesh import build_meshes
from parallel.plan import ParallelPlan
from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed
from moe.aux import collect_aux_loss, moe_layers

pytestmark = pytest.mark.dist


def _step(spec):
    model_cfg, moe_cfg = dc.configs()
    plan = ParallelPlan(**spec).validate(2, model_cfg, moe_cfg, dc.B)
    par = parallelize(dc.make_model(model_cfg, moe_cfg), plan, build_meshes(plan))
    x, y = dc.batch(0)
    n = dc.B // plan.dp
    x, y = x[par.dp_rank * n:(par.dp_rank + 1) * n], y[par.dp_rank * n:(par.dp_rank + 1) * n]
    with par.recording_comm():
        (dc.task_loss(par.model(x), y) + collect_aux_loss(par.model)).backward()
        par.clip_grad_norm_(dc.CLIP)
    return par, par.ledger.take()


def _nbytes(params):
    return sum(p.numel() * p.element_size() for p in params)


def _worker(rank, world):
    rows = []
    par, got = _step(dict(dp=2))
    rows.append(("dp2", got, {"dp_grad_reduce": _nbytes(par.model.parameters()), "other": 4}))

    par, got = _step(dict(dp=2, ep=2))
    layers = moe_layers(par.model)
    experts = {id(p) for _, m in layers for p in m.experts.parameters()}
    dense = _nbytes(p for p in par.model.parameters() if id(p) not in experts)
    T, K, D, E = dc.B * dc.S, layers[0][1].top_k, 32, layers[0][1].num_experts
    counts = 2 * E * 8  # a [P, E] int64 table per layer, sent by each rank
    a2a_total = len(layers) * (2 * counts + 4 * T * K * D * 4)  # summed over both ranks
    mine = torch.tensor([got.get("expert_all_to_all", 0)])
    dist.all_reduce(mine)
    rows.append(("ep2 grads", {k: got[k] for k in ("dp_grad_reduce", "other")},
                 {"dp_grad_reduce": dense, "other": 4}))
    rows.append(("ep2 all_to_all (sum over ranks)", int(mine), a2a_total))

    par, got = _step(dict(dp=2, zero=3))
    gathers = scatters = 0
    for unit in _fsdp_units(par.model):
        shard = sum(4 * _padded_shard_numel(p) for p in _owned(unit))
        times = 1 if unit is par.model else 2  # non-root units are gathered again in backward
        gathers += times * shard
        scatters += 2 * shard
    rows.append(("zero3 gather", got.get("zero_param_gather"), gathers))
    rows.append(("zero3 reduce-scatter", got.get("zero_grad_reduce_scatter"), scatters))
    return rows


def _fsdp_units(model):
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _owned(unit):
    """Parameters a unit manages: its subtree minus the subtrees of nested units."""
    from torch.distributed.fsdp import FSDPModule
    nested = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)
              for p in m.parameters()}
    return [p for p in unit.parameters() if id(p) not in nested]


def _padded_shard_numel(p):
    dim = next(i for i, pl in enumerate(p.placements) if pl.is_shard())
    shard_dim = p.placements[dim].dim
    shape = list(p.shape)
    shape[shard_dim] = math.ceil(shape[shard_dim] / 2)
    return math.prod(shape)


def test_ledger_equals_hand_computed_volumes():
    for rank, rows in enumerate(run_distributed(_worker, 2, timeout=180)):
        for name, got, want in rows:
            assert got == want, f"rank {rank} {name}: ledger {got} != hand-computed {want}"
