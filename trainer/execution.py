"""How one optimizer step runs: one strategy object per execution mode, so the Trainer
(steps.py) never branches on it.

  Plain          every rank runs the whole model on its rows (dp, tp, ep, etp, ZeRO, ...):
                 micro-batches with gradient accumulation, reduction at the last backward
  Pipeline       parallel.pp > 1: the schedule runs the micro-batches; a checkpoint or an
                 evaluation first drains what is in flight (PipeDream-2BW)
  ParameterServer parallel.ps_servers > 0: pull, forward/backward, push; the servers step
                 the optimizer; replicas are settled before evaluation and checkpoints

Each strategy answers: train(tr, n, scale, rec) -> StepResult, the loss of an evaluation
batch, the evaluation chunking, and what to do before the weights are read (settle) or saved.
Shapes: B sequences, S sequence length.
"""
import contextlib
from dataclasses import dataclass

import torch

from models.mtp import weighted_mtp_loss
from moe.aux import collect_aux_loss
from moe.replay import replaying
from parallel.interleave import run_interleaved

from .distributed import barrier
from .memory import model_state_bytes


@dataclass
class StepResult:
    loss: torch.Tensor | float
    aux: torch.Tensor | float
    stats: dict                 # {layer name: [RoutingStats]}
    norm: object = None         # the gradient norm before clipping (None: not taken)
    skipped: object = False     # False | "overflow" | "diverged"
    stop: bool = False          # a SIGTERM seen by any rank
    mtp: object = None          # the MTP depths' losses [K] (dp-mean; on the device until read
                                # under train.step_checks=device), or None without MTP


def mtp_fields(values_K) -> dict:
    """{mtp_loss_1 ... mtp_loss_K: value} of a step's MTP depth losses (a list, or device
    scalars until step_checks reads them), {} for None."""
    return {f"mtp_loss_{k + 1}": v for k, v in enumerate([] if values_K is None else values_K)}


class Plain:
    """Every rank runs the whole model on its share of the global batch."""

    def train(self, tr, n: int, scale: float, rec: dict) -> StepResult:
        """Forward, backward, clip and optimizer step of step n, measured as configured."""
        par = tr.par
        counting = par.recording_comm() if tr.cfg.log.comm_bytes else contextlib.nullcontext()
        peak = tr.peak_memory(n)
        with counting, peak or contextlib.nullcontext():
            loss, aux, stats, mtp_K = self._forward_backward(tr, tr.next_batch(), scale)
            with par.comm_label("other"):
                overflow = tr.scaler is not None and tr.scaler.unscale_(par.grads())
                norm = None if overflow else par.clip_grad_norm_(tr.cfg.train.grad_clip)
                if tr.checks is not None:  # train.step_checks=device: decided on the device
                    skipped = tr.checks.verdict(loss + aux, norm)
                else:
                    diverged, stop = tr.agree(loss + aux, norm)
            if tr.checks is not None:  # found_inf: a skip leaves weights and optimizer state
                tr.stager.fence()
                tr.checks.optimizer_step(tr.optimizer, tr.sched, skipped)
                par.update_router_bias(tr.cfg.moe.bias_update_rate, applied=1 - skipped)
            elif not (overflow or diverged):  # a skip leaves weights, optimizer state and schedule
                tr.stager.fence()  # an async save's copies of them are done first (on the GPU)
                tr.optimizer.step()
                tr.sched.step()
                par.update_router_bias(tr.cfg.moe.bias_update_rate)
        if par.baton is not None:  # a2a_exposed_s: seconds this step's exchanges were waited for
            rec.update(par.baton.take(wait=tr.checks is None))  # device checks: read later
        if n == tr.first_step:  # what this rank holds, by device, read from the tensors
            rec["model_state_bytes"] = model_state_bytes(tr.model, par.grads(), tr.optimizer)
        if peak is not None:
            rec["peak_mem_bytes"] = peak.peak_bytes
            if peak.reserved_bytes is not None:
                rec["peak_mem_reserved_bytes"] = peak.reserved_bytes
        parts = [loss.reshape(1), aux.reshape(1)] + ([] if mtp_K is None else [mtp_K])
        mean = par.mean_over_dp(torch.cat(parts))
        if tr.checks is not None:  # read later, with the other held steps (step_checks.py)
            return StepResult(mean[0], mean[1], stats, norm, skipped,
                              mtp=None if mtp_K is None else mean[2:])
        values = mean.tolist()
        loss, aux = values[:2]
        skipped = "overflow" if overflow else "diverged" if diverged else False
        return StepResult(loss, aux, stats, norm, skipped, stop, None if mtp_K is None else values[2:])

    def _forward_backward(self, tr, batch, scale: float):
        """(mean task loss, mean aux loss, {layer: [RoutingStats]}, mean MTP depth losses [K] or
        None) of this rank's rows, run in micro-batches; the gradient reduction runs in the
        last one's backward (the MTP loss, weighted, is in it: models/mtp.py). Under
        parallel.a2a_overlap=1f1b the forward of micro-batch i+1 runs beside the backward of
        micro-batch i (parallel/interleave.py)."""
        rows = tr.rows_per_rank
        micro = tr.task.split(batch, rows // (tr.cfg.train.micro_batch_size or rows))
        n, sums = len(micro), []
        stats = {name: [] for name, _ in tr.moe}

        def forward(i):
            part = micro[i]["samples"] if tr.replay is not None else micro[i]
            loss = tr.task.loss(tr.model, part)
            aux = collect_aux_loss(tr.model).to(loss.device)
            mtp = weighted_mtp_loss(tr.model)
            sums.append(torch.cat([loss.detach().reshape(1), aux.detach().reshape(1)]
                                  + ([] if mtp is None else [mtp[1].detach()])))
            for name, layer in tr.moe:
                if layer.last_stats is not None:
                    stats[name].append(layer.last_stats)
            total = loss + aux + (0 if mtp is None else mtp[0])
            return total * (scale / n)

        if tr.par.baton is not None:  # parallel.a2a_overlap=1f1b: F(i+1) beside B(i)
            tr.par.set_grad_sync(False)
            run_interleaved(n, forward, lambda i, total: total.backward(), tr.par.baton,
                            lambda: tr.par.set_grad_sync(True))
        else:
            for i in range(n):
                tr.par.set_grad_sync(i == n - 1)
                ids = micro[i]["expert_ids"] if tr.replay is not None else None
                with replaying(tr.model, ids):  # backward inside: a recomputed forward replays too
                    forward(i).backward()
        tr.par.finish_backward()
        total = sums[0]
        for s in sums[1:]:  # in micro-batch order, as one sum
            total = total + s
        return total[0] / n, total[1] / n, stats, (total[2:] / n if total.numel() > 2 else None)

    def eval_chunk(self, tr) -> tuple:
        """(rows per evaluation forward, whole chunks only)."""
        return tr.cfg.train.micro_batch_size or tr.rows_per_rank, False

    def eval_loss(self, tr, batch) -> torch.Tensor:
        return tr.task.loss(tr.model, batch, mtp=False)  # the main loss (MTP depths not run)

    def settle(self, tr, n: int) -> None:
        """Before the weights are read (evaluation, checkpoint): nothing to do."""

    def before_save(self, tr, n: int) -> None:
        """Before a checkpoint: nothing to do."""


class Pipeline(Plain):
    """parallel.pp > 1: the schedule runs forward and backward of the micro-batches."""

    def _forward_backward(self, tr, batch_BS1, scale: float):
        """The schedule's forward+backward, then (inside pipeline_step) the reduction once."""
        total = tr.par.pipeline_step(*tr.task.inputs_targets(batch_BS1))
        # the runner returns task + aux; split off the aux part, summed over the stages
        aux = tr.par.pipeline_aux_loss().to(total.device)
        stats = {name: [layer.last_stats] for name, layer in tr.moe if layer.last_stats is not None}
        return total.detach() - aux, aux, stats, tr.par.pipeline.mtp_terms()

    def eval_chunk(self, tr) -> tuple:
        # the schedule splits each chunk into its fixed micro-batch count: the training shape
        return tr.rows_per_rank, True

    def eval_loss(self, tr, batch) -> torch.Tensor:  # every pp rank gets the last stage's loss
        return tr.par.pipeline.evaluate(*tr.task.inputs_targets(batch))

    def before_save(self, tr, n: int) -> None:
        tr.par.pipeline.drain()  # 2bw: finish the backwards in flight (a no-op otherwise)


class ParameterServer(Plain):
    """parallel.ps_servers > 0: workers meet only at the servers (no collective per step)."""

    def __init__(self, client):
        self.client = client    # parallel.data_parallel.param_server.PSClient
        self.settled = None     # the step after which the replicas were last settled

    def train(self, tr, n: int, scale: float, rec: dict) -> StepResult:
        """Pull (waiting as the consistency rule says), forward, backward, push; the servers
        step the optimizer. The loss returned is the mean over workers (s = 0) or its own."""
        tr.stager.fence()  # the pull writes the weights an async save may still be copying
        rec["ps_staleness"] = self.client.pull(n)
        loss, aux, stats, mtp_K = self._forward_backward(tr, tr.next_batch(), 1.0)
        asked = tr.stop_request is not None and tr.stop_request.requested
        loss, aux, norm, skipped, stop_at = self.client.push(
            n, tr.sched.get_last_lr(), loss, aux, tr.cfg.train.grad_clip, stop=asked)
        tr.sched.step()
        rec["ps_bytes"] = self.client.take_traffic()
        # every worker stops after the step the servers agreed (a SIGTERM seen by any worker),
        # so all enter the checkpoint's collectives together (ServerShard.stop_step)
        stop = stop_at is not None and n >= stop_at
        return StepResult(loss, aux, stats, norm, "diverged" if skipped else False, stop,
                          None if mtp_K is None else mtp_K.tolist())  # this worker's

    def settle(self, tr, n: int) -> None:
        """Every worker has pushed step n (a barrier), then each pulls the weights after it,
        so all replicas hold the same values. Once per step (an evaluation and a checkpoint
        at the same step share it)."""
        if self.settled == n:
            return
        self.settled = n
        barrier(tr.ctx)
        self.client.pull(n + 1)
        self.client.take_traffic()  # (counted with the step, not here)

    def before_save(self, tr, n: int) -> None:
        """The servers' state into this replica: the checkpoint is an ordinary one."""
        self.settle(tr, n)
        self.client.fetch_state(tr.optimizer)


def execution_for(par, ps_client=None):
    """The strategy of this layout."""
    if ps_client is not None:
        return ParameterServer(ps_client)
    return Pipeline() if par.pipeline is not None else Plain()
