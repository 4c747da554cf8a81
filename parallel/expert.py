"""Expert parallelism applied from outside: groups, sharding, gradient reduction, clipping.

Shapes: E experts, P ranks. Terms (one pipeline stage; tp=1 unless the caller builds its own
groups):
  dp         ranks holding different tokens; dense weights are replicated over them
  ep         ranks that split the experts of every MoE layer (E/ep experts each), ep | dp
  expert-dp  dp/ep ranks holding the same experts (the same local slice)
Rank layout inside the dp ranks of a stage: ep innermost, so an expert-parallel group is a
block of ep consecutive ranks and an expert-dp group is a stride-ep slice (neighbours
exchange tokens; the same convention as parallel/plan.py). World = stages * dp.

Gradient semantics: each rank's loss is the mean over its own tokens, the trained loss is the
mean over dp ranks. Dense grads: averaged over dp. Expert grads: after backward they already
hold the sum over the ep group's tokens (the reverse all-to-all brings them home); summing
over expert-dp then covers every dp rank once, so they are divided by dp, not by expert-dp.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.ep_dispatcher import EXPERT_PARAM_ATTR, shard_layer_experts
from moe.layer import MoELayer
from moe.stats import RoutingStats
from parallel.all_to_all import CommCounter

__all__ = ["ExpertGroups", "validate_expert_layout", "expert_group_ranks",
           "build_expert_groups", "apply_expert_parallel", "is_expert_param",
           "reduce_gradients", "clip_grad_norm_", "all_reduce_load", "comm_counters"]


@dataclass(frozen=True)
class ExpertGroups:
    """The three groups a rank needs; build with build_expert_groups or from a DeviceMesh."""
    dp_group: object
    ep_group: object
    expert_dp_group: object


def validate_expert_layout(world_size: int, dp: int, ep: int, num_experts: int = None) -> None:
    """Check degrees without communicating; errors name the argument and the fix."""
    for name, v in (("world_size", world_size), ("dp", dp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if world_size % dp:
        raise ValueError(f"dp={dp} does not divide world_size={world_size}; pick dp so that "
                         "world_size = dp * (other parallel degrees)")
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp} (expert-dp = dp/ep ranks share the "
                         "same experts); pick ep among the divisors of dp")
    if num_experts is not None and num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}; "
                         "pick ep dividing num_experts")


def expert_group_ranks(world_size: int, dp: int, ep: int) -> dict:
    """Global rank lists of every dp, ep and expert-dp group (pure arithmetic)."""
    validate_expert_layout(world_size, dp, ep)
    out = {"dp": [], "ep": [], "expert_dp": []}
    for stage in range(world_size // dp):
        base = stage * dp
        out["dp"].append(list(range(base, base + dp)))
        out["ep"] += [list(range(base + b * ep, base + (b + 1) * ep)) for b in range(dp // ep)]
        out["expert_dp"] += [list(range(base + i, base + dp, ep)) for i in range(ep)]
    return out


def build_expert_groups(world_size: int, dp: int, ep: int, rank: int = None,
                        num_experts: int = None) -> ExpertGroups:
    """Create (collectively: every rank must call it) the groups of `rank`.

    Validation happens first, so bad degrees fail on every rank before any collective.
    """
    validate_expert_layout(world_size, dp, ep, num_experts)
    if not dist.is_initialized():
        raise RuntimeError("build_expert_groups needs init_process_group first")
    if dist.get_world_size() != world_size:
        raise ValueError(f"world_size={world_size} but the process group has "
                         f"{dist.get_world_size()} ranks; pass dist.get_world_size()")
    rank = dist.get_rank() if rank is None else rank
    mine = {}
    for kind, lists in expert_group_ranks(world_size, dp, ep).items():
        for ranks in lists:  # new_group is collective: create all, in the same order
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = g
    return ExpertGroups(mine["dp"], mine["ep"], mine["expert_dp"])


def is_expert_param(name_or_param) -> bool:
    """True for parameters of an MoE layer's expert bank (not router, not shared experts).

    A parameter is recognized by the mark set when sharding; a name by a path component
    equal to "experts" (e.g. "blocks.0.ffn.experts.w1"), which also works before sharding
    and after wrappers that replace parameter objects.
    """
    if isinstance(name_or_param, str):
        return "experts" in name_or_param.split(".")
    return bool(getattr(name_or_param, EXPERT_PARAM_ATTR, False))


def _expert_ids(model) -> set:
    return {id(p) for n, p in model.named_parameters() if is_expert_param(n) or is_expert_param(p)}


def apply_expert_parallel(model, ep_group, counters: bool = True) -> list:
    """Shard the experts of every MoELayer in `model` over `ep_group` (in place).

    The model must hold full, identical weights on all ranks; each rank keeps its slice.
    All layers are validated before any is changed. Returns [(name, layer)]. Each layer
    gets its own CommCounter at `layer.dispatcher.counter` when counters is True.
    """
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError("apply_expert_parallel: the model has no MoELayer; use ep=1 for a "
                         "dense model")
    P = dist.get_world_size(ep_group)
    for name, layer in layers:
        if layer.num_experts % P:
            raise ValueError(f"{name}: num_experts={layer.num_experts} is not divisible by "
                             f"the expert-parallel size {P}; pick ep dividing num_experts")
    for _, layer in layers:
        shard_layer_experts(layer, ep_group, CommCounter() if counters else None)
    return layers


def comm_counters(model) -> dict:
    """{layer name: CommCounter} of the expert-parallel layers of `model`."""
    return {n: m.dispatcher.counter for n, m in model.named_modules()
            if isinstance(m, MoELayer) and hasattr(m.dispatcher, "counter")}


def _all_reduce_sum(tensors: list, group) -> None:
    """One all-reduce per dtype over a flat copy (fewer, larger messages)."""
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=group)
        for t, chunk in zip(ts, flat.split([t.numel() for t in ts])):
            t.copy_(chunk.view_as(t))


def reduce_gradients(model, dp_group, expert_dp_group) -> None:
    """Average dense grads over dp_group; expert grads: sum over expert_dp_group, / dp size.

    Missing grads (a parameter unused on this rank) become zeros first, so every rank joins
    the same collectives with the same sizes and nothing hangs. Groups of size 1 skip the
    communication.
    """
    dp = dist.get_world_size(dp_group)
    expert = _expert_ids(model)
    dense_g, expert_g = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        (expert_g if id(p) in expert else dense_g).append(p.grad)
    with torch.no_grad():
        for grads, group in ((dense_g, dp_group), (expert_g, expert_dp_group)):
            if grads and dist.get_world_size(group) > 1:
                _all_reduce_sum(grads, group)
            if grads and dp > 1:
                torch._foreach_div_(grads, dp)


def _local_norm(grads: list, norm_type: float, dev) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=dev)
    norms = torch._foreach_norm(grads, norm_type)
    return torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]).double(), norm_type)


def clip_grad_norm_(model, max_norm: float, groups, norm_type: float = 2.0) -> torch.Tensor:
    """Clip by the global grad norm, counting every expert parameter once.

    Call after reduce_gradients: dense grads are then identical on all ranks, expert grads
    identical across expert-dp and disjoint across the ep group, so the norm is the local
    dense part combined with the ep-group reduction of the expert part. `groups` is an
    ExpertGroups (or the ep ProcessGroup itself). Returns the total norm (before clipping).
    """
    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"norm_type={norm_type!r} is not supported; use 2.0 or inf")
    ep_group = getattr(groups, "ep_group", groups)
    expert = _expert_ids(model)
    params = [p for p in model.parameters() if p.grad is not None]
    dev = params[0].grad.device if params else torch.device("cpu")
    dense_n = _local_norm([p.grad for p in params if id(p) not in expert], norm_type, dev)
    expert_n = _local_norm([p.grad for p in params if id(p) in expert], norm_type, dev)
    if norm_type == float("inf"):
        if dist.get_world_size(ep_group) > 1:
            dist.all_reduce(expert_n, op=dist.ReduceOp.MAX, group=ep_group)
        total = torch.maximum(dense_n, expert_n)
    else:
        expert_sq = expert_n.square()
        if dist.get_world_size(ep_group) > 1:
            dist.all_reduce(expert_sq, group=ep_group)
        total = (dense_n.square() + expert_sq).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for p in params:
            p.grad.mul_(coef.to(device=p.grad.device, dtype=p.grad.dtype))
    return total.float()


def all_reduce_load(stats: RoutingStats, group) -> RoutingStats:
    """Global per-expert counts: sum a RoutingStats over the ranks of `group` (the dp ranks).

    Entropy becomes the token-weighted mean. One all-reduce of a packed float64 tensor
    (exact for counts below 2**53).
    """
    E = stats.routed_E.numel()
    packed = torch.cat([stats.routed_E.double(), stats.kept_E.double(),
                        torch.tensor([stats.num_tokens, float(stats.entropy) * stats.num_tokens],
                                     dtype=torch.float64)
                        .to(stats.routed_E.device)])
    dist.all_reduce(packed, group=group)
    n = int(packed[2 * E])
    return RoutingStats(routed_E=packed[:E].round().long(), kept_E=packed[E:2 * E].round().long(),
                        num_tokens=n, top_k=stats.top_k,
                        entropy=(packed[2 * E + 1] / max(n, 1)).float())
