"""ZeRO-Offload (Ren et al. 2021): the optimizer's fp32 master copies, its state and its step
live on the host; the training device keeps the parameters the forward uses.

  zero 1/2, offload=optimizer  ZeroState's flat master slices are created on the host
                               (zero.py); reduced gradient slices are copied there, the step
                               runs there, the updated slices go back for the all-gather.
  zero 3,   offload=optimizer  HostMasters (below): a host copy of each FSDP2 local shard is
                               what the optimizer steps; the device shard is refreshed after.
  zero 3,   offload=params     FSDP2's CPUOffloadPolicy: the sharded parameters and gradients
                               themselves live on the host and are copied in for each gather.

The host buffers are always separate tensors from the training-device ones, so on a machine
whose training device is the CPU (this one) the same code path runs: placement is asserted on
the host buffers, and on CUDA they are pinned and the copies non-blocking.

Overlap (zero 3, offload=optimizer): the updated masters go back to the device on a side
stream, FSDP unit by unit in forward order, each unit's copies followed by an event; a
forward pre-hook on every unit makes the compute stream wait only for the events of the
units FSDP may gather from there (itself and the next `window`), so block 0 computes while
the later blocks' parameters are still crossing PCIe. On CPU there is no stream: the copies
run inline and the hooks have nothing to wait for. The device->host gradient copies are
issued all together after backward (non-blocking, one wait): FSDP2 offers no public point at
which one unit's reduce-scattered gradient is final before the backward ends. The step of an
optimizer class that has a fused CPU kernel (Adam, AdamW) uses it (`same_optimizer`).
"""
import inspect

import torch

from ..dtensors import like_param, local


def host_device() -> torch.device:
    return torch.device("cpu")


def pinning() -> bool:
    return torch.cuda.is_available()


def host_empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised host tensor shaped like t (pinned when CUDA exists); a meta tensor
    stays on meta (a model parallelized for planning allocates nothing)."""
    if t.is_meta:
        return torch.empty_like(t, device="meta")
    return torch.empty(t.shape, dtype=t.dtype, device=host_device(), pin_memory=pinning())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A new host tensor with t's values (pinned, copied without blocking, when CUDA exists)."""
    out = host_empty_like(t)
    return out if t.is_meta else out.copy_(t.detach(), non_blocking=pinning())


def wait_for_copies() -> None:
    """The host may read what non-blocking device->host copies wrote only after this."""
    if pinning():
        torch.cuda.current_stream().synchronize()


def same_optimizer(optimizer_cls, groups: list, defaults: dict, fused: bool):
    """optimizer_cls over `groups` with the hyperparameters in `defaults`; fused=True asks for
    the class's fused kernel (the CPU step of an offloaded optimizer) when it has one (fused
    and foreach are exclusive, so foreach is dropped)."""
    accepted = inspect.signature(optimizer_cls.__init__).parameters
    kw = {k: v for k, v in defaults.items() if k in accepted}
    if fused and "fused" in accepted:
        kw["fused"] = True
        if "foreach" in accepted:
            kw["foreach"] = None
    return optimizer_cls(groups, **kw)


class HostMasters:
    """ZeRO-3 with offload=optimizer: a host fp32 copy (`shard_of[id(p)]`) of each FSDP2
    parameter's local shard is what the optimizer steps. Same protocol as zero.ZeroState, so
    the optimizer wrapper, the gradient norm and checkpoints treat both alike:

      before_step  move each reduced gradient shard to its host master (frees the device one)
      after_step   copy the updated masters into the device shards
    """
    stage, host = 3, True
    slices = ()   # no flat slices: the masters are shaped like the FSDP2 shards

    @staticmethod
    def holds_masters() -> bool:
        """The host masters hold the parameters' own values (fp32 both): checkpoints save the
        parameters."""
        return False

    def __init__(self, model: torch.nn.Module, blocks=(), prefetch: int = 0):
        """Masters shaped like the local shards; refresh_from_params fills them (parallelize
        calls it after the weights are initialised: the model may still be on the meta device
        here, and then the masters are allocated there). blocks: the FSDP2 blocks
        (parallel/apply.py _blocks), prefetch: parallel.zero_prefetch; they size the wait
        window of each unit."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shard_of = {id(p): torch.nn.Parameter(like_param(host_empty_like(local(p)), p)) for p in self.params}
        self.units = fsdp_units(model)           # [(module, [params])] in forward order
        self.window = unit_window(blocks, prefetch)
        self.copy_stream = torch.cuda.Stream() if pinning() else None
        self.ready = {}                          # unit index -> event of its refresh copies
        for i, (module, _) in enumerate(self.units):
            module.register_forward_pre_hook(self._wait_hook(i), prepend=True)

    def _wait_hook(self, i: int):
        def wait(_module, _args):
            for j in range(i, min(i + self.window + 1, len(self.units))):
                event = self.ready.pop(j, None)
                if event is not None:
                    torch.cuda.current_stream().wait_event(event)
        return wait

    def before_step(self) -> None:
        for p in self.params:
            m = self.shard_of[id(p)]
            m.grad = None if p.grad is None else like_param(to_host(local(p.grad)), p)
            p.grad = None
        wait_for_copies()

    def after_step(self) -> None:
        """Masters -> device shards, unit by unit in forward order (side stream on CUDA)."""
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():
            for i, (_, params) in enumerate(self.units):
                with _on(self.copy_stream):
                    for p in params:
                        local(p).copy_(local(self.shard_of[id(p)]), non_blocking=pinning())
                    if self.copy_stream is not None:
                        self.ready[i] = self.copy_stream.record_event()

    def refresh_from_params(self) -> None:
        """Copy the parameters into the masters (allocating them on the host first if they
        were made while the model was still on the meta device)."""
        with torch.no_grad():
            for p in self.params:
                if local(self.shard_of[id(p)]).is_meta and not local(p).is_meta:
                    self.shard_of[id(p)] = torch.nn.Parameter(like_param(host_empty_like(local(p)), p))
                local(self.shard_of[id(p)]).copy_(local(p))

    def model_param_of(self) -> dict:
        return {id(m): p for p in self.params for m in [self.shard_of[id(p)]]}

    def full_optimizer_state(self, optimizer) -> dict:
        """{id(model param): {key: value}}: the local (shard-shaped) state tensors themselves,
        no communication (checkpoint.py wraps them as DTensors like their parameter)."""
        out = {}
        for p in self.params:
            st = optimizer.state.get(self.shard_of[id(p)])
            if st:
                out[id(p)] = {k: local(v) if isinstance(v, torch.Tensor) and v.dim() else v
                              for k, v in st.items()}
        return out

    def load_full_optimizer_state(self, optimizer, full: dict) -> None:
        for p in self.params:
            st = optimizer.state.get(self.shard_of[id(p)])
            if st is None or id(p) not in full:
                continue
            for k, v in full[id(p)].items():
                if isinstance(st.get(k), torch.Tensor):
                    local(st[k]).copy_(local(v) if isinstance(v, torch.Tensor) else torch.tensor(v))
                else:
                    st[k] = v

    def init_optimizer_state(self, optimizer) -> None:
        """Collective (the step hooks): give the optimizer its state tensors, masters unchanged."""
        if optimizer.state:
            return
        for p in self.params:
            p.grad = torch.zeros_like(p)  # before_step moves them to the masters
        step_at_zero_lr(optimizer)


def _on(stream):
    import contextlib
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def fsdp_units(model) -> list:
    """[(FSDP2 module, the trainable parameters it owns)] in module order (= forward order for
    the blocks; an MoE layer's expert and router units sit just after their block's own)."""
    from torch.distributed.fsdp import FSDPModule
    out, seen = [], set()
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in reversed(modules):   # innermost first, so each parameter goes to its owner
        own = [p for p in m.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        out.append((m, own))
    out.reverse()
    return [(m, ps) for m, ps in out if ps]


def unit_window(blocks, prefetch: int) -> int:
    """How many later units FSDP2 may gather before a unit's own forward pre-hook: the units
    of max(1, prefetch) blocks (implicit or explicit prefetch) plus the unit's own nested
    ones. Waiting for more than needed is safe; it only hides less."""
    from torch.distributed.fsdp import FSDPModule
    per_block = max((sum(isinstance(m, FSDPModule) for m in b.modules())
                     for b in blocks), default=1)
    return (max(1, prefetch) + 1) * per_block


def step_at_zero_lr(optimizer) -> None:
    """One optimizer step at lr=0 (hooks included), then gradients cleared: creates the state
    tensors a checkpoint is loaded into, leaving every parameter unchanged."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
