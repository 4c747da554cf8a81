"""Memory a rank holds: its model state by category and device (model_state_bytes, read from
the tensors), and the peak of one training step, measured the same way on CPU and CUDA.

CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` (the caching
allocator's own count of live tensor bytes).
CPU has no allocator statistics, so a TorchDispatchMode counts them: every tensor an op
returns during the step adds its storage's bytes once (storages are keyed by data pointer;
views and in-place results add nothing), and a weakref finalizer on each tensor holding a
reference takes the bytes off when the last of them dies. The peak is the largest live total
plus `baseline_bytes`, the tensors alive before the step (parameters, optimizer state and
ZeRO slices, from model_state_bytes below). Not seen: buffers inside libraries
(gloo, MKL workspaces) and storages freed outside Python references' lifetimes, so it is
the bytes of live PyTorch tensors, like the CUDA number. The hook costs Python work per op,
so the training loop runs it on the second step (the first that starts with optimizer
state, i.e. the steady state; log.peak_mem) and then every CPU_EVERY-th step
(log.peak_mem_every): a measured step of configs/default.toml runs 1.59x as long (385 vs
242 ms median, `python bench/peak_mem_cost.py`), so every 50th step costs about 1.2% of a
run. On CUDA every step, with the allocator's reserved peak (`max_memory_reserved`) beside
the allocated one.
"""
import contextlib
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.tensor import DTensor

from parallel.dtensors import local


class _LiveBytes:
    def __init__(self):
        self.live, self.peak = 0, 0
        self.storages = {}  # data_ptr -> [bytes, tensors alive that hold it]

    def add(self, t: torch.Tensor, aliases_input: bool) -> None:
        """Count `t` as a holder of its storage; a storage not seen before is new bytes,
        unless `t` aliases an op input (a view or in-place result of a tensor from before)."""
        if t.device.type == "meta":
            return
        key, nbytes = _storage_key(t)
        if key is None:
            return
        entry = self.storages.get(key)
        if entry is None:
            if aliases_input:
                return
            entry = self.storages[key] = [nbytes, 0]
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key) -> None:
        entry = self.storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[key]


class _Tracker(TorchDispatchMode):
    def __init__(self, counter: _LiveBytes):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            self.counter.add(t, _aliases_input(t, args))
        return out


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _storage_key(t):
    """((device type, data pointer), bytes) of t's storage -- a DTensor's its local tensor's
    (the mode sees a DTensor op's result, not the local ops inside it: without this every
    tensor-parallel activation went uncounted); (None, 0) for tensors without one of their
    own (other wrapper subclasses, async collective results)."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    try:
        storage = t.untyped_storage()
        return (t.device.type, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None, 0


def _aliases_input(t, args) -> bool:
    """In-place ops and views return an input's storage: nothing new was allocated."""
    key, _ = _storage_key(t)
    if key is None:
        return True
    return any(_storage_key(a)[0] == key for a in _tensors(list(args)))


def held_after(forward) -> int:
    """Bytes the tensors forward() makes still hold when it returns -- what autograd keeps
    for backward, and the output, alive while counted: the live-tensor counter around one
    call (the tests' measure of what a block keeps; deterministic)."""
    counter = _LiveBytes()
    with _Tracker(counter):
        out = forward()
    held = counter.live
    del out
    return held


CPU_EVERY = 50  # a measured CPU step costs 1.6x (bench/peak_mem_cost.py): ~1% of a run


def peak_mem_every(every: int, device: torch.device, reads: int = 0) -> int:
    """log.peak_mem_every resolved: the steps between measurements (0 = auto). reads: the
    steps between the host's reads of the device under train.step_checks=device (log.every),
    where auto measures on CUDA (a measurement synchronizes: the host would stop running ahead)."""
    if every:
        return every
    return (reads or 1) if device.type == "cuda" else CPU_EVERY


class PeakMemory:
    """`with PeakMemory(device, baseline_bytes) as pm: <one step>` then `pm.peak_bytes` (and,
    on CUDA, `pm.reserved_bytes`: the caching allocator's reserved peak; None on CPU)."""

    def __init__(self, device: torch.device, baseline_bytes: int):
        self.device, self.baseline = device, baseline_bytes
        self.peak_bytes = self.reserved_bytes = None

    @contextlib.contextmanager
    def _cuda(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        torch.cuda.synchronize(self.device)
        self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        self.reserved_bytes = int(torch.cuda.max_memory_reserved(self.device))

    @contextlib.contextmanager
    def _cpu(self):
        counter = _LiveBytes()
        with _Tracker(counter):
            yield
        self.peak_bytes = int(self.baseline + counter.peak)

    def __enter__(self):
        self._ctx = self._cuda() if self.device.type == "cuda" else self._cpu()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def model_state_bytes(model, grads: list, optimizer) -> dict:
    """This rank's model-state bytes by category and device, from the tensors it holds:
    {"params": {"cpu": n, ...}, "grads": {...}, "optimizer": {...}}. Optimizer state counts
    every tensor in optimizer.state (and ZeRO-1/2's fp32 master slices, which the optimizer
    steps, via its param_groups when they are not the model's own parameters)."""
    model_ids = {id(p) for p in model.parameters()}
    seen, out = set(), {"params": Counter(), "grads": Counter(), "optimizer": Counter()}

    def add(category, t):
        # dedupe by the held object: DTensor.to_local() makes a new (short-lived) view per
        # call, whose id() the next one may reuse, which used to drop tensors from the count
        if t is None or id(t) in seen or not isinstance(t, torch.Tensor):
            return
        seen.add(id(t))
        t = local(t)
        out[category][t.device.type] += t.numel() * t.element_size()
    for p in model.parameters():
        add("params", p)
    for g in grads:
        add("grads", g)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in model_ids:
                add("optimizer", p)  # a master slice, not a model parameter
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                add("optimizer", v)
    return {k: dict(v) for k, v in out.items()}
