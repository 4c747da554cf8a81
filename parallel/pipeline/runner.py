"""PipelineRunner: one optimizer step's forward+backward over micro-batches by the
torch.distributed.pipelining schedules (GPipe, 1F1B, interleaved 1F1B, the zero-bubble
ones), and forward-only evaluation on every schedule.

Shapes: B per-rank batch, b microbatch, S sequence, D model dim.
"""
import torch
import torch.distributed as dist

from moe import MoELayer

from ..dtensors import local
from .p2p import recv_activation, send_activation
from .schedules import ASYNC_SCHEDULES, MULTI_STAGE_SCHEDULES, SCHEDULES, V_SCHEDULES, stage_owner


class PipelineRunner:
    """One optimizer step's forward+backward over microbatches: `loss = runner.step(x, y)`.

    x (token ids) is used on the first stage, y (targets) on the last; every pp rank gets the
    same returned loss: mean task loss over microbatches plus every MoE layer's aux loss
    averaged over microbatches (what one process reports for the whole batch).
    Gradients are left unreduced over dp/edp/pool, divided by the microbatch count.
    `runner.stage_aux_loss()` is this rank's part of that aux loss (before the pp sum);
    `runner.evaluate(x, y)` is the forward-only mean task loss, on every pp rank.
    """

    has_grads = True  # step() leaves a gradient to reduce and apply (2bw's first does not)
    mtp = None        # the last stage's pipeline/mtp.StageMTP (set by split_pipeline)
    _mtp_terms = None  # the depths' losses [K] of the last step, on every pp rank

    def __init__(self, plan, meshes, model, chunks, stage_ids, loss_fn, baton=None):
        self.plan, self.meshes, self.model, self.baton = plan, meshes, model, baton
        self.chunks, self.stage_ids, self.loss_fn = chunks, stage_ids, loss_fn
        self.schedule, self.eval_schedule, self._aux = None, None, []
        self._stage_aux = torch.zeros(())
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.register_forward_hook(self._record_aux)

    def _record_aux(self, mod, _args, _out):
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self._aux.append(mod.aux_loss.detach())

    def _build(self, overlap: bool = False):
        """The torch schedule; `overlap` (parallel.a2a_overlap=1f1b, training only): its
        forward/backward pairs run interleaved through the baton (paired_steps.py), 1f1b as the
        interleaved 1F1B's one-stage order, which torch's schedule runtime can execute."""
        from torch.distributed import pipelining
        device = local(next(self.model.parameters())).device
        group = self.meshes.group("pp")
        stages = [pipelining.PipelineStage(c, s, self.plan.num_stages, device, group=group)
                  for c, s in zip(self.chunks, self.stage_ids)]
        name = self.plan.pp_schedule
        if overlap and name == "1f1b":
            name = "interleaved_1f1b"
        cls = getattr(pipelining, SCHEDULES[name].torch_class)
        arg = stages if name in MULTI_STAGE_SCHEDULES else stages[0]
        schedule = cls(arg, n_microbatches=self.plan.microbatches, loss_fn=self.loss_fn)
        if overlap:
            from .paired_steps import overlap_schedule
            schedule = overlap_schedule(schedule, self.baton)
        return schedule

    def step(self, x_BS, y_BS):
        """Forward + backward of every microbatch; gradients are left unreduced (the caller,
        Parallelized.pipeline_step, reduces them once)."""
        if self.schedule is None:
            self.schedule = self._build(overlap=self.baton is not None)
        self._aux.clear()
        losses = []
        first, last = 0 in self.stage_ids, self.plan.num_stages - 1 in self.stage_ids
        self.schedule.step(*((x_BS,) if first else ()), target=y_BS if last else None, losses=losses)
        return self._total_loss(losses, last)

    def _total_loss(self, losses, last):
        mb = self.plan.microbatches
        # on the run's device: NCCL rejects host tensors (a first stage of dense blocks only,
        # as DeepSeek-V3's, has neither a loss nor an aux loss to start from)
        device = local(next(self.model.parameters())).device
        zero = torch.zeros((), device=device)
        task = torch.stack([l.detach().float() for l in losses]).mean() if last and losses else zero
        # the last mb * layers records: the first step also runs a shape-inference forward
        n = mb * sum(isinstance(m, MoELayer) for m in self.model.modules())
        aux = torch.stack([a.float() for a in self._aux[-n:]]).sum() / mb if n else zero
        self._stage_aux = aux  # kept apart from _aux, which later (eval) forwards append to
        depth = getattr(getattr(self.model, "model_cfg", None), "mtp_depth", 0)  # on every pp rank
        mtp = self.mtp.take(mb, device) if self.mtp is not None else torch.zeros(depth, device=device)
        if self.mtp is not None:  # the losses hold the weighted MTP part: report it apart
            task = task - self.mtp.coef / depth * mtp.sum()
        total = torch.cat([(task + aux).reshape(1), mtp])
        dist.all_reduce(total, group=self.meshes.group("pp"))
        self._mtp_terms = total[1:] if depth else None
        return total[0]

    def mtp_terms(self):
        """The MTP depths' losses [K] of the last step() (mean over micro-batches), the same on
        every pp rank; None without MTP."""
        return self._mtp_terms

    def drain(self) -> None:
        """Nothing in flight between steps: the synchronous schedules flush every step (2bw
        does not: twobw.py)."""

    def stage_aux_loss(self) -> torch.Tensor:
        """The aux loss of this rank's MoE layers in the last step(), averaged over
        microbatches; summing it over the pp group gives the aux part of step()'s loss."""
        return self._stage_aux

    def evaluate(self, x_BS, y_BS) -> torch.Tensor:
        """Forward-only mean task loss over microbatches (equal-sized, so the batch mean),
        returned on every pp rank. The model's train/eval mode is the caller's.

        A schedule of its own, always run forward-only: sharing the training schedule would
        redo its shape inference (a real forward) at every train/eval switch.
        """
        self.drain()
        losses = []
        first, last = 0 in self.stage_ids, self.plan.num_stages - 1 in self.stage_ids
        if self.plan.pp_schedule in V_SCHEDULES + ASYNC_SCHEDULES:  # no torch schedule to eval
            with torch.no_grad():
                losses = self._v_forward(x_BS, y_BS)
        else:
            if self.eval_schedule is None:
                self.eval_schedule = self._build()
            with torch.no_grad():
                self.eval_schedule.eval(*((x_BS,) if first else ()), target=y_BS if last else None,
                                        losses=losses)
        task = torch.stack([l.float() for l in losses]).mean() if last and losses else torch.zeros(())
        task = task.reshape(1).to(x_BS.device)
        dist.all_reduce(task, group=self.meshes.group("pp"))
        return task[0]

    def _v_forward(self, x_BS, y_BS) -> list:
        """Forward-only losses of a V placement (zbv, dualpipev), microbatch by microbatch.

        torch 2.13's zero-bubble V schedules fail in eval() ("can't steal_bwd_input if this
        stage doesn't have backward": their local hand-over at the V's tip expects a
        backward), so evaluation walks the stages itself: stage k runs on rank k (k < pp)
        or 2pp-1-k, each activation goes to the next stage's rank by send/recv (a small
        header first: its shape and dtype), and rank 0, holding both ends, computes the loss.
        """
        plan, me, n = self.plan, self.meshes.rank("pp"), self.plan.num_stages
        group = self.meshes.group("pp")
        owner = stage_owner(plan.pp_schedule, plan.pp, plan.stages_per_rank)  # stage -> pp rank
        chunk_of = dict(zip(self.stage_ids, self.chunks))
        device = local(next(self.model.parameters())).device
        xs, ys = x_BS.chunk(plan.microbatches), y_BS.chunk(plan.microbatches)
        losses = []
        for x, y in zip(xs, ys):
            h = x
            for k in range(n):
                if owner[k] != me:
                    continue
                if k > 0 and owner[k - 1] != me:
                    h = recv_activation(dist.get_global_rank(group, owner[k - 1]), device, group)
                h = chunk_of[k](h)
                if k < n - 1 and owner[k + 1] != me:
                    send_activation(h, dist.get_global_rank(group, owner[k + 1]), group)
            if n - 1 in self.stage_ids:
                losses.append(self.loss_fn(h, y))
        return losses
