"""The Trainer: one optimizer step, its record, and what is due after it.

`Trainer.step(n)` reads top-down: the training step (the layout's execution strategy,
execution.py: plain, pipeline or parameter server), the record (loss, tokens/s, norms,
communication bytes, loss scale), evaluation when due, the log line, then MoE statistics,
the expert-load profile, a checkpoint, a stop. Everything layout-specific goes through the
parallel.Parallelized handle `par` or the strategy: this file calls no collective itself.
Under fp16 a DynamicLossScaler (optim/loss_scale.py) scales the loss and skips steps whose
gradients overflow.
"""
import time

import torch

import models
from moe.aux import reset_balance_windows
from moe.stats import merge_stats

from parallel.staging import HostStager

from . import checkpoint
from .config import to_dict
from .distributed import all_agree, any_rank
from .evaluation import held_out
from .execution import mtp_fields
from .memory import PeakMemory, model_state_bytes, peak_mem_every
from . import telemetry
from .stops import Diverged, Preempted


class Trainer:
    """Everything one optimizer step needs; `step(n)` runs step n (1-based)."""

    def __init__(self, cfg, ctx, par, optimizer, sched, scaler, sampler, files, log, task,
                 execution, first_step: int, stop_request=None, *, step_flops: float,
                 plan_check=None, replay=None, save_group=None, checks=None):
        self.cfg, self.ctx, self.par, self.model = cfg, ctx, par, par.model
        self.optimizer, self.sched, self.scaler, self.sampler = optimizer, sched, scaler, sampler
        (self.train_file, self.val_file), self.log, self.task = files, log, task
        self.execution = execution  # execution.Plain | Pipeline | ParameterServer
        self.moe = models.moe_layers(par.model)
        self.first_step = first_step  # model_state_bytes are logged on it
        self.stop_request = stop_request  # SIGTERM seen by this process
        self.in_a_row = 0  # consecutive steps skipped as non-finite
        self.last_saved = None
        # model FLOPs of one step (the planner's count, telemetry.step_flops of the whole
        # model) and the device's peak (None: no mfu)
        self.step_flops = step_flops
        self.peak_tflops = telemetry.device_peak_tflops(cfg.log.peak_tflops, ctx.device)
        self.plan_check = plan_check  # plan_check.PlanCheck on rank 0 (log.plan_check), or None
        self.replay = replay  # router_record.RoutingRecord (moe.router_replay; the train split), or None
        self.save_group = save_group  # checkpoint.async_save: the gloo group DCP writes with
        self.saving = None  # checkpoint.PendingSave in flight (async), or None
        self.stager = HostStager()  # the async save's host buffers, kept across saves
        self.checks = checks  # step_checks.DeviceChecks (train.step_checks=device), or None

    @property
    def rows_per_rank(self) -> int:
        return self.cfg.train.batch_size // self.par.dp_size

    def step(self, n: int) -> None:
        """Train step n, log it, then whatever is due after it (evaluation, MoE statistics,
        profile, checkpoint) and a SIGTERM stop. Under train.step_checks=device the step's
        record waits, with its device values, for the next read (step_checks.py): a log
        line, an evaluation, a checkpoint, a profile, a SIGTERM or the end."""
        t0 = time.perf_counter()
        scale = self.scaler.scale_value if self.scaler is not None else 1.0
        lr = self.sched.get_last_lr()
        rec = {"step": n}
        if self.checks is not None:
            self.checks.start(t0)
        r = self.execution.train(self, n, scale, rec)
        self._record_comm(rec)
        if self.checks is None:
            rec.update(mtp_fields(r.mtp))
            self._record(n, rec, r.loss, r.aux, r.norm, r.skipped, lr, time.perf_counter() - t0)
            self._after_step(n, r.stats, r.stop)
            return
        self.checks.hold(n, rec, r.loss, r.aux, r.norm, r.skipped, mtp_fields(r.mtp))
        stop = self.checks.stop_agreed(self.stop_request.requested)  # a SIGTERM reads now
        if stop or self._read_due(n):
            for m, rec_m, loss, aux, norm, skipped, lr_m, dt in self.checks.read(self.sched):
                self._record(m, rec_m, loss, aux, norm, "diverged" if skipped else False, lr_m, dt)
        self._after_step(n, r.stats, stop)

    def _read_due(self, n: int) -> bool:
        """Under train.step_checks=device: whether step n's values are read (a log line, an
        evaluation, a checkpoint, a profile or the end needs them)."""
        c = self.cfg
        return (self._due(n, c.log.every) or self._due(n, c.train.eval_every)
                or self._due(n, c.checkpoint.every) or self._due(n, c.log.profile_every, False))

    def _record(self, n: int, rec: dict, loss, aux, norm, skipped, lr: float, dt: float) -> None:
        """Step n's record (its loss, norm and skip read), the evaluation when due, the log
        line, the plan check, the divergence count and stop."""
        tokens = self.cfg.train.batch_size * self.cfg.data.seq_len
        rec.update(loss=loss, aux_loss=aux, lr=lr,
                   grad_norm=None if skipped else float(norm),
                   tokens_per_s=tokens / dt, step_time_s=dt, skipped=bool(skipped),
                   tflops=self.step_flops / self.ctx.world_size / dt / 1e12)
        if self.peak_tflops:
            rec["mfu"] = rec["tflops"] / self.peak_tflops
        if skipped == "diverged":
            rec["skip_reason"] = "non-finite loss or gradient norm"
        if self.scaler is not None:
            self._update_loss_scale(n, self.scaler.scale_value, skipped == "overflow", rec)
        self._count_divergence(n, skipped == "diverged", skipped == "overflow")
        if self._due(n, self.cfg.train.eval_every, at_end=self.cfg.train.eval_every > 0) \
                and not self.in_a_row:
            rec["val_loss"] = self.evaluate(n)
        self.log.log_step(rec)
        if self.plan_check is not None:
            self.plan_check.observe(rec)
            line = self.plan_check.due_line(n, self.first_step, self.cfg.train.steps)
            if line:
                self.log.info(line)
        if self.in_a_row:
            self._stop_if_diverged(n)

    # ------------------------------------------------------------ what the strategies use
    def next_batch(self):
        """This rank's rows of the next global batch, prepared, with the step's gradients
        cleared and the global_batch balance window reset."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)  # ZeRO: the slices' / host masters' grads
        self.model.zero_grad(set_to_none=True)      # and the model's (left by a skipped step)
        idx = self.sampler.next_indices()
        batch = self.task.prepare(self.train_file.batch(idx), idx)
        reset_balance_windows(self.model)  # global_batch balance: one window per optimizer step
        if self.replay is not None:  # the rows' recorded experts travel with them
            return {"samples": batch, "expert_ids": self.replay.ids(idx).to(batch.device)}
        return batch

    def peak_memory(self, n: int):
        """A PeakMemory for the step after the first (the first that starts with optimizer
        state: the steady state) and every log.peak_mem_every-th step when log.peak_mem, else
        None (on CPU its per-op hook stays off). Its baseline is the parameters and optimizer
        state held before the step (the step's zero_grad frees the old gradients first)."""
        every = peak_mem_every(self.cfg.log.peak_mem_every, self.ctx.device,
                               self.cfg.log.every if self.checks is not None else 0)
        second = n == min(self.first_step + 1, self.cfg.train.steps)
        if not (self.cfg.log.peak_mem and (second or n % every == 0)):
            return None
        held = model_state_bytes(self.model, [], self.optimizer)
        baseline = sum(held["params"].values()) + sum(held["optimizer"].values())
        return PeakMemory(self.ctx.device, baseline)

    def agree(self, total_loss: torch.Tensor, norm):
        """(diverged, stop) the same on every rank: a non-finite loss or gradient norm on any
        rank, a SIGTERM received by any rank. One all-reduce per step."""
        bad = not bool(torch.isfinite(total_loss.detach()).all())
        if norm is not None:
            bad = bad or not bool(torch.isfinite(norm))
        return any_rank(self.ctx, [bad, self.stop_request.requested])

    # ------------------------------------------------------------ the record
    def _record_comm(self, rec: dict) -> None:
        if not self.cfg.log.comm_bytes:
            return
        ledger = self.par.ledger
        rec["comm_bytes"] = ledger.take() if ledger is not None else {}
        if ledger is not None and ledger.multi_node:
            rec["comm_bytes_inter_node"] = ledger.take_inter_node()
        split = ledger.take_a2a_nodes() if ledger is not None else {}
        if split:
            rec["comm_bytes_a2a_nodes"] = split

    def _update_loss_scale(self, n: int, scale: float, overflow: bool, rec: dict) -> None:
        self.scaler.update(overflow)
        rec["loss_scale"] = scale
        if overflow:
            rec["skip_reason"] = "fp16 gradient overflow"
            self.log.info(f"step {n}: fp16 gradient overflow, step skipped; loss scale "
                          f"{scale:g} -> {self.scaler.scale_value:g}")

    def _count_divergence(self, n: int, diverged: bool, overflow: bool) -> None:
        if diverged:
            self.in_a_row += 1
            limit = self.cfg.train.max_skipped_steps
            self.log.info(f"step {n}: non-finite loss or gradient norm, step skipped "
                          f"({self.in_a_row} in a row" + (f", stop at {limit})" if limit else ")"))
        elif not overflow:  # fp16 overflows are the loss scaler's business, not divergence
            self.in_a_row = 0

    def _stop_if_diverged(self, n: int) -> None:
        limit = self.cfg.train.max_skipped_steps
        if limit and self.in_a_row >= limit:
            good = checkpoint.latest(self.cfg.run.dir)
            raise Diverged(f"training diverged: non-finite loss or gradient norm in {self.in_a_row} "
                           f"consecutive steps, the last at step {n} (train.max_skipped_steps="
                           f"{limit}); last good checkpoint: {good or 'none'}; lower train.lr or "
                           f"resume from it with train.resume=true")

    def _due(self, n: int, every: int, at_end: bool = True) -> bool:
        return (every > 0 and n % every == 0) or (at_end and n == self.cfg.train.steps)

    # ------------------------------------------------------------ after the step
    def _after_step(self, n: int, stats: dict, stop: bool) -> None:
        """MoE statistics and profile when due, a checkpoint when due or stopping, the stop."""
        # a collective: decided from the config, not from this rank's (pipeline stage's) layers
        if self._due(n, self.cfg.log.moe_stats_every, at_end=False) and self.cfg.moe.every > 0:
            self.log.log_moe(n, self.par.sum_routing_stats(
                {name: merge_stats(s) for name, s in stats.items() if s}))
        if self._due(n, self.cfg.log.profile_every, at_end=False) and self.cfg.moe.every > 0:
            from .expert_load import profile_at_step
            profile_at_step(self, n)
        if stop or self._due(n, self.cfg.checkpoint.every, at_end=self.cfg.checkpoint.at_end):
            self.save(n)
        self.finish_save(wait=stop or n == self.cfg.train.steps)  # the last save is waited for
        if stop:
            raise Preempted(f"stopped by SIGTERM after step {n}"
                            + (f"; checkpoint {self.last_saved} saved" if self.last_saved else "")
                            + "; continue with train.resume=true")

    @torch.no_grad()
    def evaluate(self, n: int) -> float:
        """Mean task loss over the held-out set (evaluation.held_out), the same on every rank."""
        self.execution.settle(self, n)
        self.model.eval()
        chunk, whole = self.execution.eval_chunk(self)
        total, rows = torch.zeros((), device=self.ctx.device), 0
        for count, batch in held_out(self.val_file, self.task, self.cfg.train.eval_batches,
                                     self.cfg.train.batch_size, self.par.dp_rank,
                                     self.par.dp_size, chunk, whole):
            total += self.execution.eval_loss(self, batch).to(total.device) * count
            rows += count
        self.model.train()
        return float(self.par.mean_over_dp((total / rows).reshape(1))[0])

    def save(self, n: int) -> None:
        if self.in_a_row:  # the weights may already be damaged: keep the last good checkpoint
            self.log.info(f"step {n}: no checkpoint while steps are being skipped as non-finite")
            return
        plan = self.par.plan
        self.execution.before_save(self, n)
        state = {"scheduler": self.sched.state_dict(), "sampler": self.sampler.state_dict(),
                 "config": to_dict(self.cfg),
                 "layout": {k: getattr(plan, k) for k in ("dp", "tp", "pp", "ep", "etp", "zero")}}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        self.finish_save()  # at most one save in flight
        background = self.cfg.checkpoint.async_save
        self.saving = checkpoint.begin_save(self.ctx, self.cfg.run.dir, n, self.par, self.optimizer,
                                            state, background, self.save_group, self.stager)
        if not background:
            self.finish_save()
        else:
            self.log.info(f"checkpoint of step {n}: writing in the background")

    def finish_save(self, wait: bool = True) -> None:
        """Declare the save in flight once every rank has written it (wait=False: only if that
        is already so, decided on every rank alike); a no-op when none is."""
        if self.saving is None:
            return
        if not wait and not all_agree(self.ctx, self.saving.written()):
            return
        path = checkpoint.finish_save(self.ctx, self.saving, self.cfg.checkpoint.keep)
        self.saving = None
        self.last_saved = path
        self.log.info(f"saved checkpoint {path}")
