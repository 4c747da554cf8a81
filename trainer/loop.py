"""The training run: config -> process group -> data -> model -> layout -> steps.

Shapes: B sequences, S sequence length, E experts.
Per optimizer step every data-parallel rank takes its rows of the global batch, runs them in
micro-batches (gradient accumulation), adds every MoE layer's aux loss to the task loss,
reduces gradients, clips the global norm, steps AdamW and the schedule, and optionally moves
the routers' aux-loss-free selection bias with the all-reduced expert load. Everything
layout-specific goes through the parallel.Parallelized handle `par` (parallel/parallelized.py):
this file calls no collective on a parallel group itself. `Trainer.step` reads top-down: the
training step (`_train_step`), its record, evaluation, then what is due after it.
Under fp16 a DynamicLossScaler scales the loss and skips steps whose gradients overflow.
"""
import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist

import models
from data.prepare import prepared_dir
from data.sampler import BatchSampler, eval_indices, open_split
from moe.aux import collect_aux_loss, reset_balance_windows
from moe.stats import merge_stats
from parallel.apply import parallelize
from parallel.ledger import model_state_bytes
from parallel.mesh import build_meshes
from parallel.precision import DynamicLossScaler

from . import checkpoint, lock
from .config import ConfigError, to_dict, to_toml, validate
from .distributed import any_rank, barrier, init_distributed, shutdown
from .metrics import MetricsLogger
from .model import build_model, init_fn, task_arch
from .optim import WarmupCosine, build_optimizer
from .peak_memory import PeakMemory
from .run_dir import AUTO, clear_run, prepare_run, remove_unused_auto_dir
from .stops import Diverged, Preempted, StopRequest, Stopped
from .tasks import Task, sentinels_needed, token_loss


def run(cfg) -> int:
    """Train according to `cfg` (a trainer.config.Config). ConfigError for user mistakes."""
    ctx = init_distributed(cfg.run.device, cfg.run.dist_timeout_s)
    ok = False
    try:
        code = _run(cfg, ctx)
        ok = True
        return code
    except Stopped:
        ok = True  # every rank stops at the same step: the ordinary (barrier) teardown is safe
        raise
    finally:
        shutdown(ctx, ok)


def _prepare_data(cfg, ctx) -> Path:
    """Rank 0 prepares (or finds) the token files; the others then find its cache entry.
    A failure on rank 0 is sent to every rank so all stop with the same error."""
    error = None
    if ctx.is_main:
        try:
            prepared_dir(cfg.data)
        except (OSError, ValueError, RuntimeError) as e:
            error = str(e)
    if ctx.distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(f"data preparation failed: {error}")
    return prepared_dir(cfg.data)


def _check_vocab(cfg, data_dir, arch: str) -> None:
    from data.tokenizer import load_tokenizer
    vocab = need = load_tokenizer(data_dir).vocab_size
    why = f"the tokenizer's vocabulary ({vocab}, data.tokenizer={cfg.data.tokenizer!r})"
    if arch == "switch":
        need = vocab + sentinels_needed(cfg.data.seq_len, cfg.data)
        why += f" plus {need - vocab} span-corruption sentinel ids"
    from models.hf_build import pretrained_vocab_size
    have = pretrained_vocab_size(cfg.hf)
    if have is not None and have < need:
        raise ConfigError(f"hf.pretrained={cfg.hf.pretrained!r} has vocab_size={have}, smaller than "
                          f"{why}; use a model with at least {need} token ids")
    if have is None and cfg.model.vocab_size < need:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than {why}; set "
                          f"model.vocab_size={need} or more")


def check_splits(cfg, train_sequences: int, val_sequences: int, dp: int) -> None:
    """Before step 1 (not at the first evaluation, hours in): each split must feed the layout.
    Every data-parallel rank evaluates at least one validation sequence; a global batch needs
    that many distinct training sequences."""
    d = cfg.data
    fix = (f"lower data.seq_len={d.seq_len}, raise data.max_bytes={d.max_bytes} (0 = all) or "
           f"use a larger data.source")
    if train_sequences < cfg.train.batch_size:
        raise ConfigError(f"the training split has {train_sequences} sequences of {d.seq_len} "
                          f"tokens, fewer than train.batch_size={cfg.train.batch_size}; {fix}")
    needs_val = cfg.train.eval_every > 0 or cfg.log.profile_every > 0
    if needs_val and val_sequences < dp:
        raise ConfigError(f"the validation split has {val_sequences} sequence(s) of {d.seq_len} "
                          f"tokens, fewer than the {dp} data-parallel ranks that evaluate; raise "
                          f"data.val_fraction={d.val_fraction}, {fix}, or set train.eval_every=0")


def _run(cfg, ctx) -> int:
    plan = validate(cfg, ctx.world_size)
    fresh_auto = cfg.run.dir == AUTO
    cfg, resume_from = prepare_run(cfg, ctx)  # run.dir=auto resolved; printed on rank 0; locked
    fresh_auto = fresh_auto and resume_from is None
    ok = False
    try:
        code = _train(cfg, ctx, plan, resume_from)
        ok = True
        return code
    finally:
        if ctx.is_main:
            lock.release(cfg.run.dir)
            if fresh_auto and not ok:
                remove_unused_auto_dir(Path(cfg.run.dir))


def _train(cfg, ctx, plan, resume_from) -> int:
    run_dir = Path(cfg.run.dir)
    data_dir = _prepare_data(cfg, ctx)
    arch = task_arch(cfg)
    _check_vocab(cfg, data_dir, arch)
    barrier(ctx)  # every rank has checked the run dir before rank 0 changes it
    if ctx.is_main:
        if cfg.run.overwrite:
            clear_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    train_file = open_split(data_dir, "train", cfg.data.seq_len)
    val_file = open_split(data_dir, "val", cfg.data.seq_len)
    check_splits(cfg, train_file.num_sequences, val_file.num_sequences, plan.dp)

    torch.manual_seed(cfg.train.seed)
    meshes = build_meshes(plan, ctx.device.type) if ctx.distributed else None
    # built on meta, materialised by parallelize after the split/sharding: no rank ever
    # holds the whole model
    par = parallelize(build_model(cfg, ctx.device), plan, meshes, loss_fn=token_loss,
                      init_fn=init_fn(cfg, ctx.device))
    optimizer = par.prepare_optimizer(build_optimizer(par.model, cfg.train))
    sched = WarmupCosine(optimizer, cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps,
                         cfg.train.min_lr_ratio)
    scaler = DynamicLossScaler(init_scale=cfg.train.loss_scale_init) \
        if plan.precision == "fp16" else None
    sampler = BatchSampler(train_file.num_sequences, cfg.train.batch_size, cfg.train.seed,
                           par.dp_rank, par.dp_size)
    start = 0
    if resume_from is not None:
        try:
            info = checkpoint.load(ctx, resume_from, par, optimizer)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"cannot resume from {resume_from}: {e}") from None
        sampler.load_state_dict(info["sampler"])
        sched.load_state_dict(info["scheduler"])
        if scaler is not None and "loss_scaler" in info:
            scaler.load_state_dict(info["loss_scaler"])
        start = info["step"]
    if ctx.is_main:
        (run_dir / "config.toml").write_text(to_toml(cfg))
    log = MetricsLogger(run_dir, cfg.log, cfg.train.steps, start, ctx.is_main)
    with StopRequest() as stop_request, contextlib.closing(log), \
            _parameter_server(cfg, ctx, plan, par, optimizer, start + 1) as ps:
        _announce(log, cfg, ctx, plan, par.model, data_dir, train_file, resume_from)
        trainer = Trainer(cfg, ctx, par, optimizer, sched, scaler, sampler,
                          (train_file, val_file), log,
                          Task(arch, cfg.train.seed, cfg.model.vocab_size, cfg.data, ctx.device),
                          first_step=start + 1, stop_request=stop_request, ps=ps)
        for step in range(start + 1, cfg.train.steps + 1):
            trainer.step(step)
    return 0


@contextlib.contextmanager
def _parameter_server(cfg, ctx, plan, par, optimizer, first_step: int):
    """parallel.ps_servers > 0: host this rank's shard, start RPC, yield the worker's client
    (started from the model and optimizer as they are: fresh, or loaded from a checkpoint);
    None otherwise."""
    if not plan.ps_servers:
        yield None
        return
    from parallel import param_server
    client = param_server.start(par.model, optimizer, plan.ps_servers, plan.ps_staleness,
                                ctx.rank, ctx.world_size, param_server.default_init_method(),
                                per_expert=cfg.train.optimizer != "adafactor", first_step=first_step)
    try:
        yield client
    except BaseException:
        param_server.stop(ctx.rank, plan.ps_servers, graceful=False)
        raise
    param_server.stop(ctx.rank, plan.ps_servers)


def _announce(log, cfg, ctx, plan, model, data_dir, train_file, resume_from) -> None:
    counts = models.count_params(model)
    log.info(f"moekit: {ctx.world_size} process(es) on {ctx.device.type}, layout {plan.summary()}")
    log.info(f"model: {cfg.hf.family or cfg.model.arch}, {counts['total'] / 1e6:.2f}M parameters, "
             f"{counts['active_per_token'] / 1e6:.2f}M active per token, "
             f"{len(models.moe_layers(model))} MoE layer(s)")
    layers = models.moe_layers(model)
    if layers:  # the routing semantics the run trains with (adopted models: from their config)
        log.info(f"routing ({layers[0][0]}): {layers[0][1].routing_summary()}")
    forced = [layer for _, layer in layers if layer.force_balance]
    if forced:
        log.info(f"WARNING: moe.force_balance=true in {len(forced)} MoE layer(s): routing is "
                 f"forced to an even spread (benchmarking only; losses are not a real model's)")
    log.info(f"data: {data_dir} ({train_file.num_sequences} training sequences of "
             f"{cfg.data.seq_len} tokens)")
    if resume_from is not None:
        log.info(f"resumed from {resume_from}")


class Trainer:
    """Everything one optimizer step needs; `step(n)` runs step n (1-based)."""

    def __init__(self, cfg, ctx, par, optimizer, sched, scaler, sampler, files, log, task,
                 first_step: int, stop_request=None, ps=None):
        self.cfg, self.ctx, self.par, self.model = cfg, ctx, par, par.model
        self.optimizer, self.sched, self.scaler, self.sampler = optimizer, sched, scaler, sampler
        (self.train_file, self.val_file), self.log, self.task = files, log, task
        self.moe = models.moe_layers(par.model)
        self.first_step = first_step  # model_state_bytes are logged on it
        self.stop_request = stop_request  # SIGTERM seen by this process
        self.in_a_row = 0  # consecutive steps skipped as non-finite
        self.last_saved = None
        self.ps = ps  # parallel.param_server.PSClient under parallel.ps_servers > 0
        self.ps_settled = None  # the step after which the replicas were last settled

    def step(self, n: int) -> None:
        """Train step n, log it, then whatever is due after it (evaluation, MoE statistics,
        profile, checkpoint) and a SIGTERM stop."""
        t0 = time.perf_counter()
        scale = self.scaler.scale_value if self.scaler is not None else 1.0
        lr = self.sched.get_last_lr()
        rec = {"step": n}
        loss, aux, stats, norm, skipped, stop = self._train_step(n, scale, rec)
        if self.ps is None:  # (the parameter server returns the mean over workers, or s > 0 its own)
            loss, aux = self.par.mean_over_dp(torch.stack([loss, aux])).tolist()
        dt = time.perf_counter() - t0
        tokens = self.cfg.train.batch_size * self.cfg.data.seq_len
        rec.update(loss=loss, aux_loss=aux, lr=lr, grad_norm=None if skipped else float(norm),
                   tokens_per_s=tokens / dt, step_time_s=dt, skipped=bool(skipped))
        if skipped == "diverged":
            rec["skip_reason"] = "non-finite loss or gradient norm"
        self._record_comm(rec)
        if self.scaler is not None:
            self._update_loss_scale(n, scale, skipped == "overflow", rec)
        self._count_divergence(n, skipped == "diverged", skipped == "overflow")
        if self._due(n, self.cfg.train.eval_every, at_end=self.cfg.train.eval_every > 0) \
                and not self.in_a_row:
            self._settle_ps(n)
            rec["val_loss"] = self.evaluate()
        self.log.log_step(rec)
        if self.in_a_row:
            self._stop_if_diverged(n)
        self._after_step(n, stats, stop)

    def _train_step(self, n: int, scale: float, rec: dict):
        """Forward, backward, clip and optimizer step of step n, measured as configured ->
        (loss, aux, stats, norm, skipped: False | "overflow" | "diverged", stop requested)."""
        if self.ps is not None:
            return self._ps_step(n, rec)
        counting = self.par.recording_comm() if self.cfg.log.comm_bytes else contextlib.nullcontext()
        peak = self._peak_memory(n)
        with counting, peak or contextlib.nullcontext():
            loss, aux, stats = self._forward_backward(scale)
            with self.par.comm_label("other"):
                overflow = self.scaler is not None and self.scaler.unscale_(self.par.grads())
                norm = None if overflow else self.par.clip_grad_norm_(self.cfg.train.grad_clip)
                diverged, stop = self._agree(loss + aux, norm)
            if not (overflow or diverged):  # a skip leaves weights, optimizer state and schedule
                self.optimizer.step()
                self.sched.step()
                self._update_bias()
        if n == self.first_step:  # what this rank holds, by device, read from the tensors
            rec["model_state_bytes"] = model_state_bytes(self.model, self.par.grads(), self.optimizer)
        if peak is not None:
            rec["peak_mem_bytes"] = peak.peak_bytes
        skipped = "overflow" if overflow else "diverged" if diverged else False
        return loss, aux, stats, norm, skipped, stop

    def _ps_step(self, n: int, rec: dict):
        """Parameter server: pull (waiting as the consistency rule says), forward, backward,
        push; the servers step the optimizer. No collective: workers meet only at the servers."""
        rec["ps_staleness"] = self.ps.pull(n)
        loss, aux, stats = self._forward_backward(1.0)
        loss, aux, norm, skipped = self.ps.push(n, self.sched.get_last_lr(), loss, aux,
                                                self.cfg.train.grad_clip)
        self.sched.step()
        rec["ps_bytes"] = self.ps.take_traffic()
        stop = self.stop_request is not None and self.stop_request.requested
        return loss, aux, stats, norm, "diverged" if skipped else False, stop

    def _settle_ps(self, n: int) -> None:
        """Before evaluation or a checkpoint: every worker has pushed step n (a barrier), then
        each pulls the weights after it, so all replicas hold the same values. Once per step
        (an evaluation and a checkpoint at the same step share it)."""
        if self.ps is None or self.ps_settled == n:
            return
        self.ps_settled = n
        barrier(self.ctx)
        self.ps.pull(n + 1)
        self.ps.take_traffic()  # (counted with the step, not here)

    def _record_comm(self, rec: dict) -> None:
        if not self.cfg.log.comm_bytes:
            return
        ledger = self.par.ledger
        rec["comm_bytes"] = ledger.take() if ledger is not None else {}
        if ledger is not None and ledger.multi_node:
            rec["comm_bytes_inter_node"] = ledger.take_inter_node()

    def _update_loss_scale(self, n: int, scale: float, overflow: bool, rec: dict) -> None:
        self.scaler.update(overflow)
        rec["loss_scale"] = scale
        if overflow:
            rec["skip_reason"] = "fp16 gradient overflow"
            self.log.info(f"step {n}: fp16 gradient overflow, step skipped; loss scale "
                          f"{scale:g} -> {self.scaler.scale_value:g}")

    def _after_step(self, n: int, stats: dict, stop: bool) -> None:
        """MoE statistics and profile when due, a checkpoint when due or stopping, the stop."""
        # a collective: decided from the config, not from this rank's (pipeline stage's) layers
        if self._due(n, self.cfg.log.moe_stats_every, at_end=False) and self.cfg.moe.every > 0:
            self.log.log_moe(n, self.par.sum_routing_stats(
                {name: merge_stats(s) for name, s in stats.items() if s}))
        if self._due(n, self.cfg.log.profile_every, at_end=False) and self.cfg.moe.every > 0:
            from .profiling import profile_at_step
            profile_at_step(self, n)
        if stop or self._due(n, self.cfg.checkpoint.every, at_end=self.cfg.checkpoint.at_end):
            self.save(n)
        if stop:
            raise Preempted(f"stopped by SIGTERM after step {n}"
                            + (f"; checkpoint {self.last_saved} saved" if self.last_saved else "")
                            + "; continue with train.resume=true")

    def _peak_memory(self, n: int):
        """A PeakMemory for the step after the first (the first that starts with optimizer
        state: the steady state) when log.peak_mem, else None: its per-op hook stays off.
        Its baseline is the parameters and optimizer state held before the step (the
        step's zero_grad frees the old gradients first)."""
        if not (self.cfg.log.peak_mem and n == min(self.first_step + 1, self.cfg.train.steps)):
            return None
        held = model_state_bytes(self.model, [], self.optimizer)
        baseline = sum(held["params"].values()) + sum(held["optimizer"].values())
        return PeakMemory(self.ctx.device, baseline)

    def _agree(self, total_loss: torch.Tensor, norm):
        """(diverged, stop) the same on every rank: a non-finite loss or gradient norm on any
        rank, a SIGTERM received by any rank. One all-reduce per step."""
        bad = not bool(torch.isfinite(total_loss.detach()).all())
        if norm is not None:
            bad = bad or not bool(torch.isfinite(norm))
        return any_rank(self.ctx, [bad, self.stop_request.requested])

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

    def _forward_backward(self, scale: float):
        """(mean task loss, mean aux loss, {layer: [RoutingStats]}) of this rank's share."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)  # ZeRO: the slices' / host masters' grads
        self.model.zero_grad(set_to_none=True)      # and the model's (left by a skipped step)
        idx = self.sampler.next_indices()
        batch = self.task.prepare(self.train_file.batch(idx), idx)
        reset_balance_windows(self.model)  # global_batch balance: one window per optimizer step
        if self.par.pipeline is not None:
            return self._pipeline_step(batch)
        mb = self.cfg.train.micro_batch_size or len(idx)
        micro = self.task.split(batch, len(idx) // mb)
        loss_sum = aux_sum = torch.zeros((), device=self.ctx.device)
        stats = {name: [] for name, _ in self.moe}
        for i, part in enumerate(micro):
            self.par.set_grad_sync(i == len(micro) - 1)
            loss = self.task.loss(self.model, part)
            aux = collect_aux_loss(self.model).to(loss.device)
            ((loss + aux) * (scale / len(micro))).backward()
            loss_sum, aux_sum = loss_sum + loss.detach(), aux_sum + aux.detach()
            for name, layer in self.moe:
                if layer.last_stats is not None:
                    stats[name].append(layer.last_stats)
        return loss_sum / len(micro), aux_sum / len(micro), stats

    def _pipeline_step(self, batch_BS1):
        """parallel.pp > 1: the schedule runs the micro-batches (forward and backward)."""
        total = self.par.pipeline_step(batch_BS1[:, :-1], batch_BS1[:, 1:])
        # the runner returns task + aux; split off the aux part, summed over the stages
        aux = self.par.pipeline_aux_loss().to(total.device)
        stats = {name: [layer.last_stats] for name, layer in self.moe if layer.last_stats is not None}
        return total.detach() - aux, aux, stats

    def _update_bias(self) -> None:
        rate = self.cfg.moe.bias_update_rate
        if rate <= 0:
            return
        for _, layer in self.moe:
            layer.router.update_selection_bias(rate, self.par.sum_load(layer.router.pending_load))

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        par, runner = self.par, self.par.pipeline
        count = self.cfg.train.eval_batches * self.cfg.train.batch_size
        idx = eval_indices(self.val_file.num_sequences, count, par.dp_rank, par.dp_size)
        per_rank = self.cfg.train.batch_size // par.dp_size
        # a pipeline splits each chunk into its fixed microbatch count: use the training shape
        mb = per_rank if runner is not None else self.cfg.train.micro_batch_size or per_rank
        total = torch.zeros((), device=self.ctx.device)
        if runner is not None and len(idx) >= mb:  # (a short validation split: whole chunks only)
            idx = idx[:len(idx) - len(idx) % mb]
        for chunk in [idx[i:i + mb] for i in range(0, len(idx), mb)]:
            batch = self.task.prepare(self.val_file.batch(chunk), chunk)
            if runner is not None:  # every pp rank gets the last stage's loss
                loss = runner.evaluate(batch[:, :-1], batch[:, 1:]).to(total.device)
            else:
                loss = self.task.loss(self.model, batch)
            total += loss * len(chunk)
        self.model.train()
        return float(par.mean_over_dp((total / len(idx)).reshape(1))[0])

    def save(self, n: int) -> None:
        if self.in_a_row:  # the weights may already be damaged: keep the last good checkpoint
            self.log.info(f"step {n}: no checkpoint while steps are being skipped as non-finite")
            return
        plan = self.par.plan
        if self.par.pipeline is not None:
            self.par.pipeline.drain()  # 2bw: finish the backwards in flight (a no-op otherwise)
        if self.ps is not None:  # the servers' state into this replica: an ordinary checkpoint
            self._settle_ps(n)
            self.ps.fetch_state(self.optimizer)
        state = {"scheduler": self.sched.state_dict(), "sampler": self.sampler.state_dict(),
                 "config": to_dict(self.cfg),
                 "layout": {k: getattr(plan, k) for k in ("dp", "tp", "pp", "ep", "etp", "zero")}}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        path = checkpoint.save(self.ctx, self.cfg.run.dir, n, self.par, self.optimizer, state,
                               self.cfg.checkpoint.keep)
        self.last_saved = path
        self.log.info(f"saved checkpoint {path}")
