"""Keep a module's output out of what backward holds, computing it again when needed
(parallel.recompute_modules=layernorm; Megatron's "checkpoint without output").

Checkpointing a norm alone frees nothing: the layers that read its output (attention's
projections, the router) save that output for their own backward. Here, while a block's
forward runs, the tensors autograd saves are inspected (saved-tensor hooks): one that is
the output of a chosen module (the same storage) is replaced by a note -- the module, its
input (which the module's own backward keeps anyway) and the view that was saved. The first
time backward unpacks a note, the module's forward runs again on that input (no graph) and
every saved view of the output is taken from the result. Values are equal to the forward's:
the module is deterministic (a norm), run again under the forward's autocast state.

    recompute_outputs(block, modules)   patch block.forward and each module's forward

State lives in the closure of one block's patched forward: the notes of the forward call
in progress (cleared when it returns; a note then lives only inside the saved slots that
point to it).
"""
import functools
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["recompute_outputs"]


class _Note:
    """One output of one module call, computed again at most once."""

    def __init__(self, run, x, out):
        self.run, self.x = run, x
        self.out, self.storage = weakref.ref(out), out.untyped_storage().data_ptr()
        dev = out.device.type
        self.autocast = (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev))
        self.value = None

    def matches(self, t) -> bool:
        out = self.out()
        return (out is not None and t.device == out.device and t.dtype == out.dtype
                and t.untyped_storage().data_ptr() == self.storage)

    def get(self) -> torch.Tensor:
        if self.value is None:
            dev, dtype, on = self.autocast
            with torch.no_grad(), torch.autocast(dev, dtype=dtype, enabled=on):
                self.value = self.run(self.x).contiguous()
        return self.value


class _Slot:
    """What a saved view of a noted output is packed as."""

    def __init__(self, note, t):
        self.note, self.view = note, (t.size(), t.stride(), t.storage_offset())

    def unpack(self) -> torch.Tensor:
        return self.note.get().as_strided(*self.view)


def recompute_outputs(block, modules) -> None:
    """While `block` runs forward with gradients, the contiguous outputs of `modules` are
    not held for backward by the layers reading them. (Under autocast a reader that casts
    the output keeps its own low-precision copy, which is not the output and stays: casting
    once for all readers would sum their gradients in the low precision.)"""
    notes = []

    def pack(t):
        for note in notes:
            if note.matches(t):
                return _Slot(note, t)
        return t

    def unpack(p):
        return p.unpack() if isinstance(p, _Slot) else p

    for m in modules:
        inner = m.forward

        @functools.wraps(inner)
        def forward(x, _inner=inner):
            out = _inner(x)
            if torch.is_grad_enabled() and out.is_contiguous():
                notes.append(_Note(_inner, x, out))
            return out

        m.forward = forward

    block_inner = block.forward

    @functools.wraps(block_inner)
    def block_forward(*args, **kwargs):
        with saved_tensors_hooks(pack, unpack):
            try:
                return block_inner(*args, **kwargs)
            finally:
                notes.clear()

    block.forward = block_forward
