"""The training run: config -> process group -> data -> model -> layout -> steps.

Shapes: B sequences, S sequence length, E experts.
Per optimizer step every data-parallel rank takes its rows of the global batch, runs them in
micro-batches (gradient accumulation), adds every MoE layer's aux loss to the task loss,
reduces gradients, clips the global norm, steps AdamW and the schedule, and optionally moves
the routers' aux-loss-free selection bias with the all-reduced expert load.
"""
import time
from pathlib import Path

import torch
import torch.distributed as dist

import models
from data.prepare import prepared_dir
from data.sampler import BatchSampler, eval_indices, open_split
from moe.aux import collect_aux_loss
from moe.hf_build import TASKS as HF_TASKS
from moe.stats import RoutingStats, merge_stats

from . import checkpoint
from .config import ConfigError, to_dict, to_toml, validate
from .distributed import barrier, init_distributed, shutdown
from .metrics import MetricsLogger
from .optim import WarmupCosine, build_optimizer
from .parallelism import build_layout
from .run_dir import clear_run, prepare_run
from .tasks import Task, sentinels_needed, token_loss


def run(cfg) -> int:
    """Train according to `cfg` (a trainer.config.Config). ConfigError for user mistakes."""
    ctx = init_distributed(cfg.run.device, cfg.run.dist_timeout_s)
    try:
        return _run(cfg, ctx)
    finally:
        shutdown(ctx)


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
    if cfg.model.vocab_size < need:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than {why}; set "
                          f"model.vocab_size={need} or more")


def _run(cfg, ctx) -> int:
    plan = validate(cfg, ctx.world_size)
    cfg, resume_from = prepare_run(cfg, ctx)  # run.dir=auto resolved; printed on rank 0
    run_dir = Path(cfg.run.dir)
    data_dir = _prepare_data(cfg, ctx)
    arch = HF_TASKS[cfg.hf.family] if cfg.hf.family else cfg.model.arch
    _check_vocab(cfg, data_dir, arch)
    barrier(ctx)  # every rank has checked the run dir before rank 0 changes it
    if ctx.is_main:
        if cfg.run.overwrite:
            clear_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    train_file = open_split(data_dir, "train", cfg.data.seq_len)
    val_file = open_split(data_dir, "val", cfg.data.seq_len)

    torch.manual_seed(cfg.train.seed)
    model = _build_model(cfg, ctx)
    # Our models are built on the meta device; parallelize materialises and initialises them
    # after the pipeline split and tensor/expert sharding (and after FSDP2 under ZeRO-3), so
    # a rank never holds the whole model. Init is seeded per global tensor, so every layout
    # starts from the same weights. HF models arrive initialised (moe.hf_build).
    init_fn = None
    if not cfg.hf.family:
        def init_fn(m):
            models.init_weights(m, cfg.train.seed, ctx.device)
    layout = build_layout(ctx, plan, model, loss_fn=token_loss, init_fn=init_fn)
    optimizer = layout.prepare_optimizer(model, build_optimizer(model, cfg.train))
    sched = WarmupCosine(optimizer, cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps,
                         cfg.train.min_lr_ratio)
    sampler = BatchSampler(train_file.num_sequences, cfg.train.batch_size, cfg.train.seed,
                           layout.dp_rank, layout.dp_size)
    start = 0
    if resume_from is not None:
        try:
            transform, untransform = layout.checkpoint_transforms(model)
            info = checkpoint.load(ctx, resume_from, model, optimizer, transform, untransform)
            sampler.load_state_dict(info["sampler"])
            layout.after_load(model)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"cannot resume from {resume_from}: {e}") from None
        sched.load_state_dict(info["scheduler"])
        start = info["step"]
    if ctx.is_main:
        (run_dir / "config.toml").write_text(to_toml(cfg))
    log = MetricsLogger(run_dir, cfg.log, cfg.train.steps, start, ctx.is_main)
    try:
        _announce(log, cfg, ctx, plan, model, data_dir, train_file, resume_from)
        state = _State(cfg, ctx, layout, model, optimizer, sched, sampler, train_file, val_file, log)
        state.task = Task(arch, cfg.train.seed, cfg.model.vocab_size, cfg.data, ctx.device)
        for step in range(start + 1, cfg.train.steps + 1):
            state.step(step)
    finally:
        log.close()
    return 0


def _build_model(cfg, ctx):
    """Our models on the meta device (initialised after parallelize), or a
    Hugging Face family with MoE FFNs when hf.family is set (built initialised)."""
    if cfg.hf.family:
        from moe.hf_build import build_hf_model
        if (cfg.parallel.tp, cfg.parallel.pp) != (1, 1):
            raise ConfigError("hf.family models support data/expert parallelism and ZeRO only; "
                              "set parallel.tp=1 and parallel.pp=1")
        return build_hf_model(cfg.hf, cfg.model, cfg.moe, seed=cfg.train.seed, device=ctx.device)
    return models.build_model(cfg.model, cfg.moe, device="meta")


def _announce(log, cfg, ctx, plan, model, data_dir, train_file, resume_from) -> None:
    counts = models.count_params(model)
    log.info(f"moekit: {ctx.world_size} process(es) on {ctx.device.type}, layout dp={plan.dp} "
             f"tp={plan.tp} pp={plan.pp} ep={plan.ep} zero={plan.zero}")
    log.info(f"model: {cfg.hf.family or cfg.model.arch}, {counts['total'] / 1e6:.2f}M parameters, "
             f"{counts['active_per_token'] / 1e6:.2f}M active per token, "
             f"{len(models.moe_layers(model))} MoE layer(s)")
    log.info(f"data: {data_dir} ({train_file.num_sequences} training sequences of "
             f"{cfg.data.seq_len} tokens)")
    if resume_from is not None:
        log.info(f"resumed from {resume_from}")


class _State:
    """Everything one optimizer step needs; `step(n)` runs step n (1-based)."""

    def __init__(self, cfg, ctx, layout, model, optimizer, sched, sampler, train_file, val_file, log):
        self.cfg, self.ctx, self.layout, self.model = cfg, ctx, layout, model
        self.optimizer, self.sched, self.sampler = optimizer, sched, sampler
        self.train_file, self.val_file, self.log = train_file, val_file, log
        self.moe = models.moe_layers(model)
        self.task = None

    def step(self, n: int) -> None:
        t0 = time.perf_counter()
        loss, aux, stats = self._forward_backward()
        grad_norm = self.layout.clip_grad_norm(self.model, self.cfg.train.grad_clip)
        lr = self.sched.get_last_lr()
        self.optimizer.step()
        self.sched.step()
        self._update_bias()
        loss, aux = self.layout.mean_over_data(torch.stack([loss, aux])).tolist()
        dt = time.perf_counter() - t0
        tokens = self.cfg.train.batch_size * self.cfg.data.seq_len
        rec = {"step": n, "loss": loss, "aux_loss": aux, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": tokens / dt, "step_time_s": dt}
        if self._due(n, self.cfg.train.eval_every):
            rec["val_loss"] = self.evaluate()
        self.log.log_step(rec)
        # a collective: decided from the config, not from this rank's (pipeline stage's) layers
        if self._due(n, self.cfg.log.moe_stats_every, at_end=False) and self.cfg.moe.every > 0:
            self.log.log_moe(n, self._gather_stats(stats))
        if self._due(n, self.cfg.log.profile_every, at_end=False) and self.cfg.moe.every > 0:
            from .profiling import profile_at_step
            profile_at_step(self, n)
        if self._due(n, self.cfg.checkpoint.every, at_end=self.cfg.checkpoint.at_end):
            self.save(n)

    def _due(self, n: int, every: int, at_end: bool = True) -> bool:
        return (every > 0 and n % every == 0) or (at_end and n == self.cfg.train.steps)

    def _forward_backward(self):
        self.model.train()
        idx = self.sampler.next_indices()
        batch = self.task.prepare(self.train_file.batch(idx), idx)
        runner = getattr(getattr(self.model, "moekit_parallel", None), "pipeline", None)
        if runner is not None:
            return self._pipeline_step(runner, batch)
        mb = self.cfg.train.micro_batch_size or len(idx)
        micro = self.task.split(batch, len(idx) // mb)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = aux_sum = torch.zeros((), device=self.ctx.device)
        stats = {name: [] for name, _ in self.moe}
        for i, part in enumerate(micro):
            self.layout.set_grad_sync(self.model, i == len(micro) - 1)
            loss = self.task.loss(self.model, part)
            aux = collect_aux_loss(self.model).to(loss.device)
            ((loss + aux) / len(micro)).backward()
            loss_sum, aux_sum = loss_sum + loss.detach(), aux_sum + aux.detach()
            for name, layer in self.moe:
                if layer.last_stats is not None:
                    stats[name].append(layer.last_stats)
        self.layout.sync_grads(self.model)
        return loss_sum / len(micro), aux_sum / len(micro), stats

    def _pipeline_step(self, runner, batch_BS1):
        """parallel.pp > 1: the schedule runs the micro-batches (forward and backward)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = runner.step(batch_BS1[:, :-1], batch_BS1[:, 1:])
        # the runner returns task + aux; split off the aux part, summed over the stages
        aux = runner.stage_aux_loss().float().reshape(1).to(total.device)
        dist.all_reduce(aux, group=runner.meshes.group("pp"))
        stats = {name: [layer.last_stats] for name, layer in self.moe if layer.last_stats is not None}
        return total.detach() - aux[0], aux[0], stats

    def _update_bias(self) -> None:
        rate = self.cfg.moe.bias_update_rate
        if rate <= 0:
            return
        for _, layer in self.moe:
            load_E = self.layout.sum_load(layer.router.pending_load)
            layer.router.update_selection_bias(rate, load_E)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        count = self.cfg.train.eval_batches * self.cfg.train.batch_size
        idx = eval_indices(self.val_file.num_sequences, count, self.layout.dp_rank, self.layout.dp_size)
        runner = getattr(getattr(self.model, "moekit_parallel", None), "pipeline", None)
        per_rank = self.cfg.train.batch_size // self.layout.dp_size
        # a pipeline splits each chunk into its fixed microbatch count: use the training shape
        mb = per_rank if runner is not None else self.cfg.train.micro_batch_size or per_rank
        total = torch.zeros((), device=self.ctx.device)
        if runner is not None and len(idx) >= mb:  # (a short validation split: whole chunks only)
            idx = idx[:len(idx) - len(idx) % mb]
        chunks = [idx[i:i + mb] for i in range(0, len(idx), mb)]
        for chunk in chunks:
            batch = self.task.prepare(self.val_file.batch(chunk), chunk)
            if runner is not None:  # every pp rank gets the last stage's loss
                loss = runner.evaluate(batch[:, :-1], batch[:, 1:]).to(total.device)
            else:
                loss = self.task.loss(self.model, batch)
            total += loss * len(chunk)
        mean = total / len(idx)
        self.model.train()
        return float(self.layout.mean_over_data(mean.reshape(1))[0])

    def _gather_stats(self, stats: dict) -> dict:
        """Per-layer routing counts summed over every rank (each token is routed on one rank)."""
        local = {name: merge_stats(s) for name, s in stats.items() if s}
        if not self.ctx.distributed:
            return local
        mine = {k: (v.routed_E.cpu(), v.kept_E.cpu(), v.num_tokens, v.top_k, float(v.entropy))
                for k, v in local.items()}
        every = [None] * self.ctx.world_size
        dist.all_gather_object(every, mine)
        merged = {}
        for part in every:
            for k, (routed, kept, n, top_k, ent) in part.items():
                merged.setdefault(k, []).append(RoutingStats(routed, kept, n, top_k, torch.tensor(ent)))
        return {k: merge_stats(v) for k, v in merged.items()}

    def save(self, n: int) -> None:
        plan = self.layout.plan
        state = {"scheduler": self.sched.state_dict(), "sampler": self.sampler.state_dict(),
                 "config": to_dict(self.cfg),
                 "layout": {k: getattr(plan, k) for k in ("dp", "tp", "pp", "ep", "zero")}}
        transform, _ = self.layout.checkpoint_transforms(self.model)
        path = checkpoint.save(self.ctx, self.cfg.run.dir, n, self.model, self.optimizer, state,
                               self.cfg.checkpoint.keep, transform)
        self.log.info(f"saved checkpoint {path}")
