"""Data parallelism and ZeRO 1/2/3 for models with MoE layers.

Three kinds of parameters, reduced over different groups (see mesh.py), always divided by
dp (the number of distinct data streams; tp ranks share a stream and its loss):
  dense  (everything outside MoE layers):        sum over dp   / dp
  pool   (router, shared experts of MoE layers): sum over pool / dp  (pool = dp*tp ranks that
         see distinct tokens in MoE layers; under tp each holds part of a microbatch)
  expert (MoELayer.experts):                      sum over edp  / dp  (the all-to-all backward
         already summed the tokens of the ep group into each local expert's gradient)

zero=0: gradients are all-reduced at the end of every backward (autograd callback, like DDP).
zero=1: same all-reduce; the optimizer keeps state only for this rank's 1/n slice of each
        parameter (flattened, padded to n equal slices) and all-gathers updated slices.
zero=2: gradients are reduce-scattered at the end of backward into the slices and the full
        gradients freed.
zero=3: FSDP2 fully_shard (experts over edp, router over pool, blocks and root over dp).
Shapes: P ranks in a reduction group, L slice length of one parameter.
"""
import inspect

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe import MoELayer


def param_kinds(model: torch.nn.Module) -> dict:
    """Map each parameter (by id) to 'dense', 'pool' or 'expert'."""
    kinds = {}
    for mod in model.modules():
        if isinstance(mod, MoELayer):
            for p in mod.parameters():
                kinds[id(p)] = "pool"
            for p in mod.experts.parameters():
                kinds[id(p)] = "expert"
    return {id(p): kinds.get(id(p), "dense") for p in model.parameters()}


def reduction_groups(model, meshes) -> list:
    """[(kind, group, divisor, params)] for the parameters that need gradient reduction."""
    kinds, plan = param_kinds(model), meshes.plan
    groups = {"dense": meshes.group("dp"), "pool": meshes.group("pool"), "expert": meshes.group("edp")}
    out = []
    for kind in ("dense", "pool", "expert"):
        params = [p for p in model.parameters() if p.requires_grad and kinds[id(p)] == kind]
        if params:
            out.append((kind, groups[kind], plan.dp, params))
    return out


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _settled_grad(p):
    """The parameter's gradient as a local tensor laid out like the parameter.

    A missing gradient becomes zeros so every rank sends the same sizes (an expert that got no
    tokens, a layer skipped on one rank). DTensor grads left Partial (tp) are reduced first.
    """
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    return _local(p.grad)


def _all_reduce_mean(grads, group, divisor) -> None:
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        flat.div_(divisor)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class GradSync:
    """Reduces gradients once per backward, at its end (zero 0/1) or into slices (zero 2)."""

    def __init__(self, buckets, sharded_hook=None):
        self.buckets, self.sharded_hook = buckets, sharded_hook
        self.enabled, self._queued = True, False
        for _, _, _, params in buckets:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _p):
        if self.enabled and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self):
        self._queued = False
        self.sync()

    def sync(self) -> None:
        if self.sharded_hook is not None:
            self.sharded_hook()
            return
        for _, group, divisor, params in self.buckets:
            _all_reduce_mean([_settled_grad(p) for p in params], group, divisor)


# ---------------------------------------------------------------- ZeRO 1/2 slices
class _Slices:
    """This rank's flat 1/P slice of every parameter of one reduction bucket."""

    def __init__(self, group, divisor, params):
        self.group, self.divisor, self.params = group, divisor, params
        self.P, self.r = dist.get_world_size(group), dist.get_rank(group)
        self.L = [-(-_local(p).numel() // self.P) for p in params]
        self.shards = [torch.nn.Parameter(self._full_rows(_local(p).detach(), L)[self.r].clone())
                       for p, L in zip(params, self.L)]

    def _full_rows(self, t, L):  # flat, zero-padded to P*L, viewed [P, L]
        flat = t.reshape(-1)
        pad = self.P * L - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(self.P, L)

    def reduce_scatter(self, free_full: bool) -> None:
        """Sum grads over the group into this rank's slices (accumulating), divided."""
        rows = torch.cat([self._full_rows(_settled_grad(p), L) for p, L in zip(self.params, self.L)], 1)
        out = rows[self.r].clone()
        if self.P > 1:
            dist.reduce_scatter_tensor(out, rows.reshape(-1).contiguous(), group=self.group)
        out.div_(self.divisor)
        for s, g in zip(self.shards, out.split(self.L)):
            s.grad = g.clone() if s.grad is None else s.grad.add_(g)
        if free_full:
            for p in self.params:
                p.grad = None

    def take_synced(self) -> None:
        """zero=1: grads were all-reduced in full; keep this rank's slice of them."""
        for p, s, L in zip(self.params, self.shards, self.L):
            g = self._full_rows(_settled_grad(p), L)[self.r]
            s.grad = g.clone() if s.grad is None else s.grad.add_(g)
            p.grad = None

    def slice_of(self, t, L):
        """This rank's [L] slice of a tensor laid out like the local parameter."""
        return self._full_rows(t, L)[self.r]

    def gather_full(self, slices, which=None) -> list:
        """Collective over the group: the full local-parameter-shaped tensors of `slices`, one
        [L] slice for each parameter index in `which` (default: every parameter, in order)."""
        which = range(len(self.params)) if which is None else which
        mine = torch.cat([s.detach() for s in slices])
        rows = mine.new_empty(self.P * mine.numel())
        if self.P > 1:
            dist.all_gather_into_tensor(rows, mine, group=self.group)
        else:
            rows.copy_(mine)
        rows = rows.view(self.P, -1)
        out, offset = [], 0
        for i in which:
            p, L = self.params[i], self.L[i]
            out.append(rows[:, offset:offset + L].reshape(-1)[:_local(p).numel()].view_as(_local(p)))
            offset += L
        return out

    def all_gather(self) -> None:
        """Write the updated slices back into the full parameters."""
        with torch.no_grad():
            for p, full in zip(self.params, self.gather_full(self.shards)):
                _local(p).copy_(full)


class ZeroState:
    """Per-model ZeRO-1/2 bookkeeping: the slices of each bucket and the stage."""

    def __init__(self, buckets, stage: int):
        self.stage = stage
        self.slices = [_Slices(group, divisor, params) for _, group, divisor, params in buckets]
        self.kinds = [kind for kind, _, _, _ in buckets]
        self.shard_of = {id(p): s for sl in self.slices for p, s in zip(sl.params, sl.shards)}

    def after_backward(self) -> None:  # zero=2 only
        for sl in self.slices:
            sl.reduce_scatter(free_full=True)

    def refresh_from_params(self) -> None:
        """Re-copy the parameters into the master slices (after loading weights into the model:
        the slices are copies, so they would otherwise keep the old values)."""
        with torch.no_grad():
            for sl in self.slices:
                for p, s, L in zip(sl.params, sl.shards, sl.L):
                    s.copy_(sl.slice_of(_local(p).detach(), L))

    def model_param_of(self) -> dict:
        """id(slice) -> the model parameter it is a slice of."""
        return {id(s): p for sl in self.slices for p, s in zip(sl.params, sl.shards)}

    def full_optimizer_state(self, optimizer) -> dict:
        """Collective: {id(model param): {key: value}} with every per-slice state tensor gathered
        into the full local-parameter shape (scalars such as Adam's step kept as they are).

        Gathers one tensor per parameter and key over the bucket's group: a full copy of the
        state passes through every rank, which is fine at our model sizes (checkpoints only).
        Every rank holds state for the same slices, so all ranks issue the same collectives.
        """
        out = {}
        for sl in self.slices:
            for i, (p, s, L) in enumerate(zip(sl.params, sl.shards, sl.L)):
                st = optimizer.state.get(s)
                if not st:
                    continue
                full = {}
                for key in sorted(st):
                    v = st[key]
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == L:
                        full[key] = sl.gather_full([v], [i])[0].clone()
                    else:
                        full[key] = v.clone() if isinstance(v, torch.Tensor) else v
                out[id(p)] = full
        return out

    def load_full_optimizer_state(self, optimizer, full: dict) -> None:
        """Inverse of full_optimizer_state (local, no communication): keep this rank's slice of
        each full local-parameter-shaped tensor in `full` ({id(model param): {key: value}})."""
        for sl in self.slices:
            for p, s, L in zip(sl.params, sl.shards, sl.L):
                if id(p) not in full:
                    continue
                st = {}
                for key, v in full[id(p)].items():
                    if isinstance(v, torch.Tensor) and v.shape == _local(p).shape and v.dim() > 0:
                        st[key] = sl.slice_of(v.to(s.device), L).clone()
                    else:
                        st[key] = v.clone() if isinstance(v, torch.Tensor) else v
                optimizer.state[s] = st

    def init_optimizer_state(self, optimizer) -> None:
        """Collective: give the slice optimizer its state tensors (so a checkpoint can be loaded
        into them) by one step with zero gradients at lr=0, which leaves the slices unchanged."""
        if optimizer.state:
            return
        for sl in self.slices:
            for s in sl.shards:
                s.grad = torch.zeros_like(s)
        lrs = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = 0.0
        optimizer.step()
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def shard_optimizer(optimizer, zero_state: ZeroState):
    """A new optimizer of the same class and hyperparameters over this rank's slices.

    Parameters the optimizer does not hold keep no slice state. Steps update the slices and
    all-gather them into the model's parameters.
    """
    groups = []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": [zero_state.shard_of[id(p)] for p in g["params"]]})
    accepted = inspect.signature(type(optimizer).__init__).parameters
    sharded = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})

    def pre(_opt, _args, _kwargs):
        if zero_state.stage == 1:
            for sl in zero_state.slices:
                sl.take_synced()

    def post(_opt, _args, _kwargs):
        for sl in zero_state.slices:
            sl.all_gather()

    sharded.register_step_pre_hook(pre)
    sharded.register_step_post_hook(post)
    return sharded


# ---------------------------------------------------------------- ZeRO 3 (FSDP2)
def apply_fsdp(model, meshes, blocks, roots=None, mp_policy=None) -> None:
    """fully_shard experts over edp, other MoE params over pool, blocks and roots over dp.

    roots: the modules whose forward is called (default [model]); with several pipeline
    stages per rank these are the stage shells, each its own FSDP2 root.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as _fully_shard
    mp_policy = mp_policy or MixedPrecisionPolicy()
    plan = meshes.plan

    def fully_shard(module, mesh, mp_policy):  # all FSDP2 calls pick the shard dim below
        return _fully_shard(module, mesh=mesh, mp_policy=mp_policy,
                            shard_placement_fn=_shard_dim_for(mesh.size()))

    edp, pool, dp = meshes.expert["edp"], meshes.pool["pool"], meshes.dense["dp"]
    for mod in model.modules():
        if isinstance(mod, MoELayer):
            fully_shard(mod.experts, mesh=edp, mp_policy=mp_policy)
            _divide_by(mod.experts, edp, plan.dp)
            rest = [m for m in (mod.router, mod.shared_experts) if m is not None]
            for m in rest:
                fully_shard(m, mesh=pool, mp_policy=mp_policy)
                _divide_by(m, pool, plan.dp)
    for block in blocks:
        fully_shard(block, mesh=dp, mp_policy=mp_policy)
    for root in roots or [model]:
        fully_shard(root, mesh=dp, mp_policy=mp_policy)


def _divide_by(fsdp_module, mesh, dp: int) -> None:
    # reduce-scatter sums, then divides by dp (not by the mesh size). Sum-only collectives
    # because gloo has no PREMUL_SUM; but not on a 1-rank mesh, where FSDP2 then skips the
    # division along with the (absent) collective.
    fsdp_module.set_gradient_divide_factor(float(dp))
    if mesh.size() > 1:
        fsdp_module.set_force_sum_reduction_for_comms(True)


def _shard_dim_for(n: int):
    """FSDP2 shards dim 0 by default; a [1, D, F] dense-FFN weight (or fewer local experts than
    ranks) would then sit whole on one rank, so such tensors are split on their largest dim."""
    from torch.distributed.tensor import Shard

    def choose(p):
        shape = _local(p).shape if isinstance(p, DTensor) else p.shape
        if len(shape) == 0 or shape[0] >= n:
            return Shard(0)
        return Shard(max(range(len(shape)), key=lambda d: shape[d]))
    return choose
