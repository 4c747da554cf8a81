"""ZeRO-1/2: each rank keeps optimizer state (and, at stage 2, gradients) for a 1/P slice.

Shapes: P ranks in a reduction group (dp, pool or edp, see grad_sync.py), L slice length of
one parameter. Each parameter is flattened, zero-padded to P*L and cut into P slices; the
optimizer steps this rank's fp32 slices (the "master" copies) and the updated slices are
all-gathered back into the model's parameters.
zero=1: gradients are all-reduced in full (GradSync); each rank keeps its slice of them.
zero=2: gradients are reduce-scattered straight into the slices and the full ones freed.
offload=optimizer: the slices (and so the optimizer state and step) live on the host
(offload.py); reduced gradient slices are copied there and updated slices copied back for the
all-gather. zeropp_quantize_grads: the zero=2 reduce-scatter runs block-quantized (zeropp.py).
param_dtype=bf16 (the ZeRO paper's mixed precision): the model's parameters and gradients are
held in bf16 (cast_params, after the fp32 slices were taken) and the slices stay fp32 masters;
gradients reduce and parameters gather in bf16, ZeRO-2 holds its gradient slices in bf16 (made
fp32 only for the step), and checkpoints save and load the fp32 masters (as slices:
zero_shards.py), never the bf16 copies.
"""
import torch
import torch.distributed as dist

from ..dtensors import local
from ..reduce import all_gather_single
from .grad_sync import settled_grad
from .offload import same_optimizer, step_at_zero_lr, to_host, wait_for_copies


class _Slices:
    """This rank's flat 1/P slice of every parameter of one reduction bucket."""

    def __init__(self, group, divisor, params, host: bool, reduce_scatter_fn):
        self.group, self.divisor, self.params = group, divisor, params
        self.reduce_scatter_fn = reduce_scatter_fn  # dist.reduce_scatter_tensor's signature
        self.P, self.r = dist.get_world_size(group), dist.get_rank(group)
        self.L = [-(-local(p).numel() // self.P) for p in params]
        self.device = local(params[0]).device  # where the collectives run
        own = to_host if host else torch.clone
        self.shards = [torch.nn.Parameter(own(self._full_rows(_master(local(p).detach()), L)[self.r]))
                       for p, L in zip(params, self.L)]
        self.low_grads = [None] * len(params)  # ZeRO-2 under bf16 parameters: the held slices

    def _full_rows(self, t, L):  # flat, zero-padded to P*L, viewed [P, L]
        flat = t.reshape(-1)
        pad = self.P * L - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(self.P, L)

    def low(self) -> bool:
        """Whether the parameters are held in a lower precision than the master slices."""
        return local(self.params[0]).dtype != self.shards[0].dtype

    def reduce_scatter(self, free_full: bool) -> None:
        """Sum grads over the group into this rank's slices (accumulating), divided. Under bf16
        parameters the result is the step's bf16 gradient slice (written, once per step: the
        reduction runs in the last backward before the step) until before_step makes it fp32."""
        rows = torch.cat([self._full_rows(settled_grad(p), L) for p, L in zip(self.params, self.L)], 1)
        out = rows[self.r].clone()
        if self.P > 1:
            self.reduce_scatter_fn(out, rows.reshape(-1).contiguous(), group=self.group)
        out.div_(self.divisor)
        for i, (s, g) in enumerate(zip(self.shards, out.split(self.L))):
            if self.low():
                self.low_grads[i] = g.to(s.device, copy=True)
            else:
                s.grad = g.to(s.device, copy=True) if s.grad is None else s.grad.add_(g.to(s.device))
        if free_full:
            for p in self.params:
                p.grad = None

    def take_synced(self) -> None:
        """zero=1: grads were all-reduced in full; keep this rank's slice of them."""
        for p, s, L in zip(self.params, self.shards, self.L):
            g = self._full_rows(settled_grad(p), L)[self.r]
            s.grad = g.to(s.device, s.dtype, copy=True) if s.grad is None else s.grad.add_(g.to(s.device))
            p.grad = None

    def grads_to_masters(self) -> None:
        """ZeRO-2 under bf16 parameters: the held bf16 gradient slices as the masters' fp32
        grads, for the step (after_step frees those again)."""
        for s, g in zip(self.shards, self.low_grads):
            if g is not None:
                s.grad = g.to(s.device, s.dtype, copy=True)

    def slice_of(self, t, L):
        """This rank's [L] slice of a tensor laid out like the local parameter."""
        return self._full_rows(t, L)[self.r]

    def gather_full(self, slices, which=None, dtype=None) -> list:
        """Collective over the group: the full local-parameter-shaped tensors of `slices`, one
        [L] slice for each parameter index in `which` (default: every parameter, in order),
        gathered in `dtype` (default: the slices')."""
        which = range(len(self.params)) if which is None else which
        mine = torch.cat([s.detach() for s in slices]).to(self.device, dtype)
        rows = mine.new_empty(self.P * mine.numel())
        if self.P > 1:
            all_gather_single(rows, mine, group=self.group)
        else:
            rows.copy_(mine)
        rows = rows.view(self.P, -1)
        out, offset = [], 0
        for i in which:
            p, L = self.params[i], self.L[i]
            out.append(rows[:, offset:offset + L].reshape(-1)[:local(p).numel()].view_as(local(p)))
            offset += L
        return out

    def all_gather(self) -> None:
        """Write the updated slices back into the full parameters (gathered in their dtype)."""
        with torch.no_grad():
            for p, full in zip(self.params, self.gather_full(self.shards, dtype=local(self.params[0]).dtype)):
                local(p).copy_(full)


class ZeroState:
    """Per-model ZeRO-1/2 bookkeeping: the slices of each bucket and the stage.

    Protocol shared with offload.HostMasters (what shard_optimizer, grads.py and checkpoints
    use): shard_of, before_step, after_step, refresh_from_params, model_param_of,
    init_optimizer_state; checkpoints read this state's slices through pieces()."""

    def __init__(self, buckets, stage: int, host: bool = False, reduce_scatter_fn=None):
        """The slices are fp32 copies of the parameters as they are now (cast_params may then
        hold the parameters in bf16)."""
        self.stage, self.host = stage, host
        rs = reduce_scatter_fn or dist.reduce_scatter_tensor
        self.slices = [_Slices(group, divisor, params, host, rs) for _, group, divisor, params in buckets]
        self.kinds = [kind for kind, _, _, _ in buckets]
        self.shard_of = {id(p): s for sl in self.slices for p, s in zip(sl.params, sl.shards)}
        self._where = {id(p): (sl, i) for sl in self.slices for i, p in enumerate(sl.params)}

    def after_backward(self) -> None:  # zero=2 only
        for sl in self.slices:
            sl.reduce_scatter(free_full=True)

    def before_step(self) -> None:
        for sl in self.slices:
            if self.stage == 1:
                sl.take_synced()
            elif sl.low():
                sl.grads_to_masters()
        if self.host:
            wait_for_copies()

    def after_step(self) -> None:
        for sl in self.slices:
            sl.all_gather()
            if sl.low():  # the fp32 gradients existed for the step only
                for s in sl.shards:
                    s.grad = None

    def slice_grad(self, p):
        """The ZeRO-2 gradient slice this rank holds for model parameter p (bf16 under bf16
        parameters, until the step makes it the master's fp32 grad)."""
        sl, i = self._where[id(p)]
        return sl.low_grads[i] if sl.low() and sl.low_grads[i] is not None else sl.shards[i].grad

    def cast_params(self, dtype) -> None:
        """Hold the model's parameters in `dtype` (bf16), the slices staying fp32 masters."""
        with torch.no_grad():
            for sl in self.slices:
                for p in sl.params:
                    p.data = p.data.to(dtype)

    def refresh_from_params(self) -> None:
        """Re-copy the parameters into the master slices (after loading weights into the model:
        the slices are copies, so they would otherwise keep the old values). Not under bf16
        parameters: the masters would lose their low bits (a checkpoint loads them instead)."""
        with torch.no_grad():
            for sl in self.slices:
                if sl.low():
                    raise RuntimeError("refresh_from_params with bf16 parameters would round the fp32 "
                                       "masters; load them from a checkpoint (state_dict.py)")
                for p, s, L in zip(sl.params, sl.shards, sl.L):
                    s.copy_(sl.slice_of(local(p).detach(), L))

    def pieces(self) -> list:
        """[(model param, its master slice [L], flat start r L, slice index)]: where each
        parameter's slice lies, for checkpoints (zero_shards.py; no communication)."""
        return [(p, s, sl.r * L, sl) for sl in self.slices for p, s, L in zip(sl.params, sl.shards, sl.L)]

    def gather_params(self) -> None:
        """Collective: every parameter from its master slices (after a checkpoint load wrote
        the masters in place)."""
        for sl in self.slices:
            sl.all_gather()

    def holds_masters(self) -> bool:
        """Whether the fp32 masters differ from the (bf16) parameters: checkpoints save them."""
        return any(sl.low() for sl in self.slices)

    def full_masters(self) -> dict:
        """Collective: {id(model param): the fp32 master, full local-parameter shape} (tests and
        inspection; checkpoints write the slices where they are: zero_shards.py)."""
        return {id(p): full.clone() for sl in self.slices
                for p, full in zip(sl.params, sl.gather_full(sl.shards))}

    def model_param_of(self) -> dict:
        """id(slice) -> the model parameter it is a slice of."""
        return {id(s): p for sl in self.slices for p, s in zip(sl.params, sl.shards)}

    def init_optimizer_state(self, optimizer) -> None:
        """Collective (the step's all-gather): give the slice optimizer its state tensors (so a
        checkpoint can be loaded into them), the slices unchanged."""
        if optimizer.state:
            return
        for sl in self.slices:
            for s in sl.shards:
                s.grad = torch.zeros_like(s)
            if self.stage == 1:  # before_step adds the model's grads into the slices
                for p in sl.params:
                    p.grad = None
        step_at_zero_lr(optimizer)


def _master(t):
    """A master copy's dtype for parameter values t: fp32 for lower-precision floats."""
    return t.float() if t.is_floating_point() and t.element_size() < 4 else t


def shard_optimizer(optimizer, zero_state):
    """A new optimizer of the same class and hyperparameters over the tensors `zero_state`
    (ZeroState, or offload.HostMasters) steps instead of the model's parameters; host-resident
    ones use the class's fused CPU step. zero_state.before_step / after_step run around
    every step (slice the gradients / move them to the host; all-gather or copy back).

    Parameters the optimizer does not hold keep no slice state.
    """
    groups = []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": [zero_state.shard_of[id(p)] for p in g["params"]]})
    sharded = same_optimizer(type(optimizer), groups, optimizer.defaults, fused=zero_state.host)
    sharded.register_step_pre_hook(lambda *_: zero_state.before_step())
    sharded.register_step_post_hook(lambda *_: zero_state.after_step())
    return sharded
