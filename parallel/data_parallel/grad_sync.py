"""Data-parallel gradient reduction for models with MoE layers (zero 0, 1 and 2).

Three kinds of parameters, reduced over different groups (see mesh.py), always divided by
dp (the number of distinct data streams; tp ranks share a stream and its loss):
  dense  (everything outside MoE layers):        sum over dp   / dp
  pool   (router, shared experts of MoE layers): sum over pool / dp  (pool = dp*tp ranks that
         see distinct tokens in MoE layers; under tp each holds part of a microbatch)
  expert (MoELayer.experts):                      sum over edp  / dp  (the all-to-all backward
         already summed the tokens of the ep group into each local expert's gradient)
The reduction runs once, at the end of the backward that has it enabled (an autograd
callback, like DDP): zero 0/1 all-reduce the full gradients, zero 2 hands over to
ZeroState.after_backward (reduce-scatter into slices). zero 3 is FSDP2's (parallel/data_parallel/fsdp.py).
"""
import torch
from torch.distributed.tensor import DTensor

from ..dtensors import local
from ..kinds import KINDS
from ..reduce import all_reduce_flat

def reduction_buckets(model, meshes, kinds: dict) -> list:
    """[(kind, group, divisor, params)] for the trainable parameters, one bucket per kind."""
    groups = {"dense": meshes.group("dp"), "pool": meshes.group("pool"), "expert": meshes.group("edp")}
    out = []
    for kind in KINDS:
        params = [p for p in model.parameters() if p.requires_grad and kinds[id(p)] == kind]
        if params:
            out.append((kind, groups[kind], meshes.plan.replicas, params))
    return out


def settled_grad(p):
    """The parameter's gradient as a local tensor laid out like the parameter.

    A missing gradient becomes zeros so every rank sends the same sizes (an expert that got no
    tokens, a layer skipped on one rank). DTensor grads left Partial (tp) are reduced first.
    """
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    return local(p.grad)


class GradSync:
    """Reduces gradients once per backward, at its end; `enabled` False skips it (gradient
    accumulation microsteps, pipeline microbatches) until `sync()` or an enabled backward."""

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
            all_reduce_flat([settled_grad(p) for p in params], group, divisor)
