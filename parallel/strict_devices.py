"""Strict collectives: every tensor handed to a collective must be on the run's device.

NCCL rejects host tensors, gloo takes anything: a CPU-only test suite cannot see a collective
that would fail on a GPU cluster (the pipeline's loss sum on a stage without MoE layers was
one: a CPU tensor all-reduced over the pipeline group). `strict_collectives(device)` is a
context manager for tests and for GPU runs: while it is active, a TorchDispatchMode looks at
every c10d op and functional collective (the ops parallel/ledger.py counts) and raises
one line naming the op, the tensor's device, the expected one and the call site (the
innermost frame of this project's code). Device types are compared (cuda:1 is a cuda device
like cuda:0: the rank's own device is the launcher's business).
"""
import contextlib
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["strict_collectives", "WrongDeviceError"]

_ROOT = Path(__file__).resolve().parents[1]
_HERE = Path(__file__).resolve()


class WrongDeviceError(RuntimeError):
    """A collective was handed a tensor on another device than the run's."""


def _call_site() -> str:
    """'file:line in function' of the innermost frame of this project's code (not torch's,
    not this file's), or '?' when there is none."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path == _HERE or _ROOT not in path.parents or ".venv" in path.parts:
            continue
        return f"{path.relative_to(_ROOT)}:{frame.lineno} in {frame.name}"
    return "?"


def check_devices(op_name: str, args, device: torch.device) -> None:
    """WrongDeviceError when a tensor among args is not on `device`'s type."""
    for t in tree_leaves(args):
        if isinstance(t, torch.Tensor) and t.device.type != device.type:
            raise WrongDeviceError(f"strict collectives: {op_name} was handed a {t.device} tensor "
                                   f"{tuple(t.shape)}, the run's device is {device} (call site: "
                                   f"{_call_site()}); create it on the run's device")


class _Strict(TorchDispatchMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            check_devices(f"{func.namespace}.{func._opname}", (args, kwargs or {}), self.device)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def strict_collectives(device):
    """Within: a collective handed a tensor off `device` raises WrongDeviceError."""
    with _Strict(torch.device(device)):
        yield
