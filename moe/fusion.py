"""Fused ops on CUDA: a pure function of tensors, compiled once per process by inductor,
which fuses its pointwise ops and reductions into few kernels (eager aten launches one per op,
each reading and writing whole tensors). On other devices the function runs eagerly, as is.
Used inside moekit's custom ops (moe/activations.py, moe/router_ops.py), so a model compiled
from outside sees one opaque op either way.
"""
import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def run_fused(fn, device_of: torch.Tensor, *args):
    """fn(*args), compiled when `device_of` is on CUDA."""
    return (_compiled(fn) if device_of.is_cuda else fn)(*args)


def is_plain(t: torch.Tensor) -> bool:
    """An ordinary tensor or parameter (not a DTensor or another subclass), where moekit's
    fused paths apply; a fake tensor (the planner's traced step,
    parallel/planner/traced_bytes.py) stands for one."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) or isinstance(t, FakeTensor)
