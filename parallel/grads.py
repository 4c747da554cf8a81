"""Global gradient norm and clipping that count every parameter element once, whatever the layout.

A rank's gradient tensor for a parameter may be a full copy (dp replicas), a tp piece, an
expert-parallel piece (of an expert's d_ff too, under etp), a ZeRO-2 slice or an FSDP2 shard.
Within one pipeline stage the dp*tp ranks hold `replicas = dp*tp / pieces` copies of each
element, so the world-wide sum of (local squared norm / replicas) is the squared norm of the
whole model's gradient. A
weight held by two pipeline stages (tied embeddings) is counted on the first one only.
"""
import torch
import torch.distributed as dist

from .dtensors import local, shard_pieces


def held_grad(p, zero):
    """The gradient this rank holds for parameter p: its ZeRO-2 slice (bf16 under bf16
    parameters); under ZeRO-3 offload its host master's once the step moved it there; else
    p.grad (may be None)."""
    if zero is not None and id(p) in zero.shard_of:
        if zero.stage == 2:
            return zero.slice_grad(p)
        if zero.stage == 3 and p.grad is None:
            return zero.shard_of[id(p)].grad
    return p.grad


def weighted_grads(model, plan, kinds: dict, zero, counted_elsewhere=frozenset()):
    """[(local grad, weight)]: weight = 1/replicas of each element among the ranks of a stage
    (0 for a copy whose norm another stage counts)."""
    pool = plan.pool
    out = []
    for p in model.parameters():
        g = held_grad(p, zero)
        if g is None:
            continue
        kind = kinds.get(id(p), "dense")
        split = plan.ep * plan.etp if kind == "expert" else 1  # expert slices: ep x etp pieces
        pieces = split * shard_pieces(g)
        if g is not p.grad:  # a ZeRO-2 slice of the (tp/ep/etp-local) parameter
            slices = {"dense": plan.replicas, "pool": pool, "expert": plan.edp}[kind]
            pieces = split * slices * shard_pieces(p)
        weight = 0.0 if id(p) in counted_elsewhere else 1.0 / max(pool // pieces, 1)
        out.append((local(g), weight))
    return out


def grad_norm(items: list, device, distributed: bool) -> torch.Tensor:
    """The global L2 norm (same value on every rank) of weighted_grads items: an fp32 scalar,
    fp64 when the gradients are fp64 (summed in the wider of fp32 and their dtype)."""
    acc = torch.float64 if any(g.dtype == torch.float64 for g, _ in items) else torch.float32
    total = torch.zeros((), dtype=acc, device=device)
    by_weight = {}  # one foreach kernel per weight, dtype and device, not four per tensor
    for g, weight in items:
        if weight:
            by_weight.setdefault((weight, g.dtype, g.device), []).append(g)
    for (weight, _, _), grads in by_weight.items():
        norms = torch._foreach_norm(grads, 2, dtype=acc)
        total += torch.stack(norms).square().sum().to(device) * weight
    if distributed:
        dist.all_reduce(total)
    return total.sqrt()


def clip_(items: list, norm: torch.Tensor, max_norm: float, eps: float = 1e-6) -> None:
    """Scale every gradient so the global norm `norm` becomes at most max_norm."""
    if max_norm <= 0:
        raise ValueError(f"max_norm={max_norm} must be > 0 (train.grad_clip); use a positive value")
    scale = torch.clamp(max_norm / (norm + eps), max=1.0)
    for g, _ in items:
        g.mul_(scale.to(g.device, g.dtype))


def clip_grad_norm_(par_or_model, max_norm: float) -> torch.Tensor:
    """The call an earlier README documented, `parallel.grads.clip_grad_norm_(model, 1.0)`.

    Since parallelize() returns a Parallelized handle, the layout lives on the handle, not
    on the model: pass the handle (the same as `par.clip_grad_norm_(max_norm)`). A plain
    module is accepted where no layout can apply (no process group), where torch's own clip
    counts every element once; under a process group it names the handle to use."""
    if not isinstance(par_or_model, torch.nn.Module):
        return par_or_model.clip_grad_norm_(max_norm)
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise TypeError("parallel.grads.clip_grad_norm_ needs the Parallelized handle under a "
                        "process group (the model alone does not say its layout): call "
                        "par.clip_grad_norm_(max_norm) with par = parallelize(model, plan, meshes)")
    return torch.nn.utils.clip_grad_norm_(par_or_model.parameters(), max_norm)
