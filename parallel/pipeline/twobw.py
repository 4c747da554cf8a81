"""PipeDream-2BW (Narayanan et al., ICML 2021): asynchronous 1F1B with double-buffered weights,
parallel.pp_schedule = "2bw".

Shapes: b micro-batch (sequences), S sequence, D model dim; m micro-batches per optimizer
step, p = pp stages (one per rank), w = p - 1 - stage: the forwards a stage runs ahead.

The micro-batches of all steps form one stream n = 0, 1, 2, ... (batch t holds n in
[t m, (t+1) m)). Stage s runs F(n) then B(n - w) at every slot n, with no flush between
optimizer steps: `step(x, y)` (one per trainer step) runs the m slots of its batch, so the
last w backwards of batch t run during step t+1.
Weights: every forward of batch t and its backward use the version the stage had when
batch t began (its "stash": the parameter tensors as they were, kept alive by autograd and
by this runner), so a gradient is always taken on one version. Step t hands the optimizer
the gradient of batch t-1 (complete on every stage by the end of step t, since m >= p):
    W(t+1) = W(t) - lr * grad f_t(W(t-1))       (2BW's delayed update; step 0 has none)
Two versions live at once: the stash of batch t-1 (until its last backward, early in step
t) and the current parameters (also batch t's stash). Before the optimizer updates the
parameters in place, they move to a fresh copy (`_unalias`) if a stash still shares them,
after the older stash is freed: so at most 2 weight versions are held.
`drain()` finishes the backwards in flight (before evaluation, a checkpoint, the end): the
next step refills the pipeline. A drain changes no value, only when gradients are taken,
and the gradient not yet applied (batch t's, due at step t+1) is part of the checkpoint
(`pending`, saved by parallel/state_dict.py), so a resumed run continues exactly.
"""
from collections import deque

import torch
import torch.distributed as dist
from torch.func import functional_call

from .p2p import activation_messages, recv_activation
from .runner import PipelineRunner



class TwoBWRunner(PipelineRunner):
    """PipelineRunner's interface (step, stage_aux_loss, evaluate, drain), one stage per rank
    (split_pipeline prunes the model and builds it for pp_schedule=2bw)."""

    def __init__(self, plan, meshes, model, chunks, stage_ids, loss_fn, baton=None):
        super().__init__(plan, meshes, model, chunks, stage_ids, loss_fn, baton)  # (refused: plan.py)
        self.stage, self.p, self.m = meshes.pp_rank, plan.pp, plan.microbatches
        self.w = self.p - 1 - self.stage
        self.group = meshes.group("pp")
        self.n = 0                  # next micro-batch to run forward
        self.flight = deque()       # (n, input, output or loss) awaiting backward
        self.stash = {}             # batch -> {name: leaf tensor sharing that version}
        self.pending = {}           # batch -> {name: gradient}: complete, not yet applied
        self.sends = []             # isend works not yet known complete
        self.losses, self.has_grads = {}, False

    @property
    def params(self) -> dict:
        """{name: parameter} of the stage, read when used (materialising a meta model and
        FSDP-like wrappers replace the parameter objects after the split)."""
        return dict(self.model.named_parameters())

    # ---- the schedule
    def step(self, x_BS, y_BS):
        t = self.n // self.m
        xs, ys = x_BS.chunk(self.m), y_BS.chunk(self.m)
        self._aux.clear()
        for j in range(self.m):
            self._forward(xs[j], ys[j])
            if len(self.flight) > self.w:  # steady state: one backward per forward
                self._backward()
        self._hand_over(t - 1)
        return self._loss_of(t)

    def drain(self) -> None:
        """Run every backward still in flight (the next step refills the pipeline)."""
        while self.flight:
            self._backward()
        for work in self.sends:
            work.wait()
        self.sends.clear()

    def _version(self, batch: int) -> dict:
        if batch not in self.stash:  # the parameters as they are now, no copy: .data, not
            # detach(), so the optimizer's in-place updates of the parameter (once _hand_over
            # moved it off this storage) do not bump a version counter autograd checks here
            self.stash[batch] = {k: p.data.requires_grad_(p.requires_grad)
                                 for k, p in self.params.items()}
        return self.stash[batch]

    def _forward(self, x, y):
        n, batch = self.n, self.n // self.m
        if self.stage > 0:
            x = self._recv(self.stage - 1).requires_grad_()
        out = functional_call(self.model, self._version(batch), (x,))
        if self.stage == self.p - 1:
            out = self.loss_fn(out, y)
            self.losses.setdefault(batch, []).append(out.detach())
        else:
            self._send(out.detach(), self.stage + 1)
        self.flight.append((n, x, out))
        self.n += 1

    def _backward(self):
        n, x, out = self.flight.popleft()
        if self.stage == self.p - 1:
            out.backward()
        else:
            torch.autograd.backward(out, self._recv(self.stage + 1))
        if self.stage > 0:
            self._send(x.grad, self.stage - 1)
        if n % self.m == self.m - 1:  # the batch's last backward: its gradient is complete
            batch = n // self.m
            version = self.stash.pop(batch)
            self.pending[batch] = {k: (v.grad / self.m if v.grad is not None else None)
                                   for k, v in version.items()}

    def _hand_over(self, batch: int) -> None:
        """Give the parameters batch `batch`'s gradient (None at the first step), then move them
        off any stash that still shares their storage, so the optimizer's in-place update
        leaves that version intact."""
        grads = self.pending.pop(batch, None)
        self.has_grads = grads is not None
        for k, p in self.params.items():
            p.grad = grads[k] if grads is not None else None
        live = {v[k].untyped_storage().data_ptr() for v in self.stash.values() for k in v}
        with torch.no_grad():
            for p in self.params.values():
                if p.untyped_storage().data_ptr() in live:
                    p.data = p.data.clone()

    def _loss_of(self, batch: int) -> torch.Tensor:
        last = self.stage == self.p - 1
        return self._total_loss(self.losses.pop(batch, []) if last else [], last)

    # ---- point to point (parallel/pipeline/'s header protocol; sends do not block)
    def _send(self, h, stage: int) -> None:
        dst = dist.get_global_rank(self.group, stage)
        self.sends = [w for w in self.sends if not w.is_completed()]  # (their tensors freed)
        self.sends += [dist.isend(t, dst, group=self.group) for t in activation_messages(h)]

    def _recv(self, stage: int):
        device = next(iter(self.params.values())).device
        return recv_activation(dist.get_global_rank(self.group, stage), device, self.group)

    # ---- checkpoints and evaluation
    def pending_state(self) -> dict:
        """{name: gradient} not yet applied (after drain(): the last batch's), for a checkpoint."""
        if len(self.pending) > 1:
            raise RuntimeError("2bw: more than one pending gradient; call drain() first")
        grads = next(iter(self.pending.values()), None)
        return {} if grads is None else {k: g for k, g in grads.items() if g is not None}

    def set_pending(self, grads: dict) -> None:
        """Restore the gradient a checkpoint held: the next step applies it."""
        batch = self.n // self.m - 1
        self.pending = {batch: {k: grads.get(k) for k in self.params}} if grads else {}
