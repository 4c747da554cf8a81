"""Global gradient norm and clipping that count every parameter element once, whatever the layout.

A rank's gradient tensor for a parameter may be a full copy (dp replicas), a tp piece, an
expert-parallel piece, a ZeRO-2 slice or an FSDP2 shard. Within one pipeline stage the
dp*tp ranks hold `replicas = dp*tp / pieces` copies of each element, so the world-wide sum
of (local squared norm / replicas) is the squared norm of the whole model's gradient.
"""
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from .data import _local


def _dtensor_pieces(t) -> int:
    if not isinstance(t, DTensor):
        return 1
    return math.prod(t.device_mesh.size(i) for i, pl in enumerate(t.placements) if isinstance(pl, (Shard, _StridedShard)))


def _grad_items(model, state):
    """(local grad tensor, replicas) for every gradient this rank holds."""
    plan = state.plan
    pool = plan.dp * plan.tp
    zero = state.zero_state
    for p in model.parameters():
        kind = state.kinds.get(id(p), "dense")
        expert_pieces = plan.ep if kind == "expert" else 1
        if zero is not None and zero.stage == 2 and id(p) in zero.shard_of:
            g = zero.shard_of[id(p)].grad
            slices = {"dense": plan.dp, "pool": pool, "expert": plan.edp}[kind]
            pieces = expert_pieces * slices * _dtensor_pieces(p)
        else:
            g = p.grad
            pieces = expert_pieces * _dtensor_pieces(g if g is not None else p)
        if g is not None:
            yield g, max(pool // pieces, 1)


def grad_norm(model) -> torch.Tensor:
    """The global L2 norm of all gradients (same value on every rank), as an fp32 scalar."""
    state = getattr(model, "moekit_parallel", None)
    items = list(_grad_items(model, state)) if state is not None else \
        [(p.grad, 1) for p in model.parameters() if p.grad is not None]
    p0 = next(model.parameters())
    total = torch.zeros((), dtype=torch.float32, device=_local(p0).device)
    for g, replicas in items:
        total += _local(g).float().pow(2).sum() / replicas
    if state is not None and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def _all_grads(model):
    state = getattr(model, "moekit_parallel", None)
    zero = state.zero_state if state is not None else None
    for p in model.parameters():
        g = zero.shard_of[id(p)].grad if zero is not None and zero.stage == 2 and id(p) in zero.shard_of else p.grad
        if g is not None:
            yield _local(g)


def clip_grad_norm_(model, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients so their global norm is at most max_norm; returns the norm before."""
    if max_norm <= 0:
        raise ValueError(f"max_norm={max_norm} must be > 0 (train.grad_clip); use a positive value")
    norm = grad_norm(model)
    scale = torch.clamp(max_norm / (norm + eps), max=1.0)
    for g in _all_grads(model):
        g.mul_(scale.to(g.device, g.dtype))
    return norm
