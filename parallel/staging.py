"""The host copy an async checkpoint writes from (checkpoint.async), and DCP's stager for it.

    stager = HostStager()                       # kept across saves (it owns the buffers)
    dcp.async_save(state, ..., async_stager=stager)
    ...                                         # forward and backward of the next step
    stager.fence()                              # before the optimizer changes the weights

A CUDA tensor is copied into a pinned host buffer, non-blocking, on a side stream that first
waits for the current one: the training thread only enqueues the copies, and the next
forward and backward run beside them. The buffers are allocated on the first save and reused
after (one save is in flight at a time: the trainer finishes a save before it begins the
next). `fence()` makes the current stream wait for the copies, so the optimizer step cannot
change a tensor still being read; DCP's writer thread waits for them before it writes.
A DTensor's local part is copied once (into a DTensor on the same spec); ZeRO-1/2's pieces
piece by piece. On the CPU the copies are plain clones, made at once.
"""
import threading
from concurrent.futures import Future

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from .data_parallel.zero_shards import pieces_to_host


class HostStager:
    """dcp.async_save's stager: stage(state) copies the state to host memory (see above)."""
    should_synchronize_after_execute = False

    def __init__(self):
        self.buffers = {}     # key path -> pinned host tensor (CUDA sources only)
        self.stream = None    # the side stream the CUDA copies run on
        self.copied = None    # CUDA event: the last stage's copies are done

    def stage(self, state_dict):
        """The host copy; a Future of it when CUDA copies are in flight (DCP's writer thread
        waits for it), else the copy itself."""
        self.copied = None
        out = self._copy(state_dict, ())
        if self.copied is None:
            return out
        done, event = Future(), self.copied

        def wait():
            try:
                event.synchronize()
                done.set_result(out)
            except BaseException as e:  # noqa: BLE001 - handed to the writer thread
                done.set_exception(e)
        threading.Thread(target=wait, name="moekit-checkpoint-staging", daemon=True).start()
        return done

    def fence(self) -> None:
        """The current stream waits for the last stage's copies (no host wait)."""
        if self.copied is not None:
            torch.cuda.current_stream().wait_event(self.copied)

    def synchronize_staging(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()

    def close(self) -> None:
        pass

    def _copy(self, state, key: tuple):
        from torch.distributed.tensor import DTensor
        if isinstance(state, dict):
            return {k: self._copy(v, key + (k,)) for k, v in state.items()}
        if isinstance(state, list):
            return [self._copy(v, key + (i,)) for i, v in enumerate(state)]
        if isinstance(state, ShardedTensor):
            return pieces_to_host(state, lambda t, i: self._tensor(t, key + (i,)))
        if isinstance(state, DTensor):
            # the copy becomes the local part of a DTensor on the same spec (from_local would
            # move a host local back to a CUDA mesh's device)
            return DTensor(self._tensor(state.to_local(), key), state._spec, requires_grad=False)
        if isinstance(state, torch.Tensor):
            return self._tensor(state, key)
        return state

    def _tensor(self, t: torch.Tensor, key: tuple) -> torch.Tensor:
        t = t.detach()
        if not t.is_cuda:
            return t.to("cpu", copy=True)
        if self.copied is None:  # the first CUDA tensor of this stage
            self.stream = self.stream or torch.cuda.Stream(t.device)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            self.copied = torch.cuda.Event()
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            buf.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # a temporary source is not reused before the copy
            self.copied.record(self.stream)
        return buf
