"""Keep a module's output out of what backward holds, computing it again when needed
(parallel.recompute_modules=layernorm; Megatron's "checkpoint without output").

Checkpointing a norm alone frees nothing: the layers that read its output (attention's
projections, the router) save that output for their own backward -- or a tensor made from
it alone: under autocast the projections' one low-precision copy (moe/cast_once.py), under
tensor parallelism the sequence-gathered input (parallel/tensor/one_d.py), which those
announce (cast_once.announce). Here, while a block's forward runs, the tensors autograd saves
are inspected (saved-tensor hooks): one that shares storage with a watched tensor -- the
output of a chosen module, or one announced as made from a watched tensor -- is replaced by a
note (the view that was saved, and for a DTensor its layout). The first time backward unpacks
a note, the module's forward runs again on its input (which the module's own backward keeps
anyway; no graph), and each announced tensor is made again from it (a cast, a gather over tp:
the gather is a collective in backward, every tp rank reaching it in the same order, as
Megatron's sequence parallelism gathers its kept shard again). Values are equal to the
forward's: the module is deterministic (a norm), run again under the forward's autocast state.

    recompute_outputs(block, modules)   patch block.forward and each module's forward

State lives in the closure of one block's patched forward: the notes of the forward call
in progress (cleared, and the watch marks taken off the tensors, when it returns; a note then
lives only inside the saved slots that point to it).
"""
import functools
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from moe.cast_once import WATCH

__all__ = ["recompute_outputs"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor without an autograd op (this runs inside a pack hook)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _key(t: torch.Tensor):
    """(device, dtype, storage pointer) of t's local tensor; None for a tensor without a
    storage of its own (a wrapper subclass other than DTensor): never matched."""
    x = _local(t)
    try:
        return x.device, x.dtype, x.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _owns_storage(t: torch.Tensor) -> bool:
    """t is the whole of its storage (a fresh result), so its storage pointer names it alone."""
    x = _local(t)
    return _key(t) is not None and x.storage_offset() == 0 and x.is_contiguous() \
        and x.untyped_storage().nbytes() == x.numel() * x.element_size()


class _Note:
    """One watched tensor of a block's forward, made again in backward: once, and kept while
    saved slots point to it, when backward reads it; a note no slot points to (the fp32 norm
    output a gather or a cast was made from) is made on the way and not kept."""

    def __init__(self, make, out):
        self.make, self.out, self.key = make, weakref.ref(out), _key(out)
        self.value, self.slots = None, 0

    def matches(self, key) -> bool:
        return self.out() is not None and key == self.key

    def get(self) -> torch.Tensor:
        if self.value is not None:
            return self.value
        value = self.make()
        if self.slots:
            self.value = value
        return value


def _module_output(run, x):
    """make() of a module's output: run(x) again, without a graph, under today's autocast."""
    dev = x.device.type
    dtype, on = torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev)

    def make():
        with torch.no_grad(), torch.autocast(dev, dtype=dtype, enabled=on):
            return run(x).contiguous()
    return make


def _made_from(note: _Note, rebuild):
    """make() of a tensor announced as rebuild(the note's tensor)."""
    def make():
        with torch.no_grad():
            return rebuild(note.get())
    return make


class _Slot:
    """What a saved view of a noted tensor is packed as."""

    def __init__(self, note, t):
        x = _local(t)
        self.note, self.view = note, (x.size(), x.stride(), x.storage_offset())
        note.slots += 1
        self.layout = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None

    def unpack(self) -> torch.Tensor:
        x = _local(self.note.get()).as_strided(*self.view)
        if self.layout is None:
            return x
        mesh, placements, shape, stride = self.layout
        return DTensor.from_local(x, mesh, placements, run_check=False, shape=shape, stride=stride)


def recompute_outputs(block, modules) -> None:
    """While `block` runs forward with gradients, the contiguous outputs of `modules`, and
    what is announced as made from them alone, are not held for backward by the layers
    reading them. (Under autocast a reader that casts the output by itself -- autocast's own
    cast -- keeps that copy, which is not announced and stays.)"""
    notes = []

    def watch(out, make) -> None:
        if not _owns_storage(out):   # a view's storage pointer is its base's: not watched
            return
        note = _Note(make, out)
        notes.append(note)
        setattr(out, WATCH, lambda made, rebuild: watch(made, _made_from(note, rebuild)))

    def pack(t):
        if notes:
            key = _key(t)
            for note in notes if key is not None else ():
                if note.matches(key):
                    return _Slot(note, t)
        return t

    def unpack(p):
        return p.unpack() if isinstance(p, _Slot) else p

    for m in modules:
        inner = m.forward

        @functools.wraps(inner)
        def forward(x, _inner=inner):
            out = _inner(x)
            if torch.is_grad_enabled():
                watch(out, _module_output(_inner, x))
            return out

        m.forward = forward

    block.outputs_recomputed = tuple(modules)   # parallel/compile.py keeps these eager
    block_inner = block.forward

    @functools.wraps(block_inner)
    def block_forward(*args, **kwargs):
        with saved_tensors_hooks(pack, unpack):
            try:
                return block_inner(*args, **kwargs)
            finally:
                for note in notes:
                    out = note.out()
                    if out is not None and hasattr(out, WATCH):
                        delattr(out, WATCH)
                notes.clear()

    block.forward = block_forward
