"""The training run assembled: config -> process group -> data -> model -> layout -> steps
(the Trainer, steps.py, runs them).

Every rank checks the config, prepares (rank 0) or finds the token files, builds the model
on the meta device, applies the layout (parallel.parallelize), builds the optimizer and
schedule, resumes from a checkpoint when asked, and hands the steps to the Trainer with the
layout's execution strategy (execution.py). The parameter server's RPC lives for the run.
"""
import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import models
from data.prepare import prepared_dir
from data.sampler import BatchSampler, open_split
from optim import DynamicLossScaler, WarmupCosine, build_optimizer
from parallel.apply import parallelize
from parallel.mesh import build_meshes

from . import checkpoint, lock, membership, telemetry
from .config import ConfigError, compile_choice, to_toml, validate
from .distributed import barrier, init_distributed, shutdown
from .execution import execution_for
from .metrics import MetricsLogger
from .plan_check import PlanCheck, enabled as plan_check_enabled
from .model import build_model, init_fn, task_arch
from .run_dir import AUTO, clear_run, prepare_run, remove_unused_auto_dir
from .step_checks import DeviceChecks, resolve_step_checks
from .steps import Trainer
from .stops import StopRequest, Stopped
from .tasks import Task, sentinels_needed, token_loss

def run(cfg) -> int:
    """Train according to `cfg` (a trainer.config.Config). ConfigError for user mistakes."""
    ctx = init_distributed(cfg.run.device, cfg.run.dist_timeout_s,
                           group_of_one=cfg.parallel.param_dtype != "fp32")
    beat = _heartbeat(cfg, ctx)
    ok = False
    try:
        code = _run(cfg, ctx)
        ok = True
        return code
    except Stopped:
        ok = True  # every rank stops at the same step: the ordinary (barrier) teardown is safe
        raise
    finally:
        shutdown(ctx, ok)  # the teardown barrier with the heartbeat still beating:
        if beat is not None:  # a peer still closing files must not see this rank as hung
            beat.stop()


def _heartbeat(cfg, ctx):
    """run.hang_timeout_s > 0 under several processes: this rank's heartbeat thread, started."""
    if not (ctx.distributed and ctx.store is not None and cfg.run.hang_timeout_s > 0):
        return None
    from .heartbeat import Heartbeat
    return Heartbeat(ctx.store, ctx.rank, ctx.world_size, cfg.run.hang_timeout_s).start()


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
    try:
        plan = validate(cfg, ctx.world_size)
    except ConfigError as e:  # at another world size than last time: say so (elastic jobs)
        if "parallel." not in str(e) or cfg.run.dir == AUTO:
            raise
        before = membership.read(cfg.run.dir)
        raise ConfigError(membership.explain_layout_error(str(e), before, ctx.world_size)) from None
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
    replay = _routing_record(cfg)
    if replay is not None:  # the rollouts are the training split; validation stays the source's
        train_file = replay
    check_splits(cfg, train_file.num_sequences, val_file.num_sequences, plan.dp)

    torch.manual_seed(cfg.train.seed)
    meshes = build_meshes(plan, ctx.device.type) if ctx.distributed else None
    # built on meta, materialised by parallelize after the split/sharding: no rank ever
    # holds the whole model
    whole = build_model(cfg, ctx.device)
    described = _describe(cfg, whole)  # before a pipeline split leaves this rank its stage
    if replay is not None:
        try:
            replay.check(cfg, len(models.moe_layers(whole)))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    flops = telemetry.step_flops(cfg, whole)  # likewise
    micro_tokens = (cfg.train.micro_batch_size or cfg.train.batch_size // plan.dp) * cfg.data.seq_len
    par = parallelize(whole, plan, meshes, loss_fn=token_loss, init_fn=init_fn(cfg, ctx.device),
                      fp8_rows=micro_tokens)
    optimizer = par.prepare_optimizer(build_optimizer(par.model, cfg.train))
    if plan.precision == "fp8":
        from parallel.fp8 import fp8_lines
        described = described + fp8_lines(par.model, micro_tokens, ctx.device, bool(plan.compile))
    sched = WarmupCosine(optimizer, cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps,
                         cfg.train.min_lr_ratio)
    checks = resolve_step_checks(cfg, plan, optimizer, ctx.device)
    if checks != "host" or cfg.train.step_checks != "auto" or ctx.device.type == "cuda":
        described = described + [f"step checks: {checks} (train.step_checks={cfg.train.step_checks}"
                                 + (f"; loss, gradient norm and skips read every {cfg.log.every} "
                                    f"steps, log.every)" if checks == "device" else
                                    "; every step reads its loss and gradient norm)")]
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
    elif cfg.checkpoint.init_from:
        _init_from(cfg, ctx, par)
    nodes = membership.gather(ctx)
    if ctx.is_main:
        (run_dir / "config.toml").write_text(to_toml(cfg))
    log = MetricsLogger(run_dir, cfg.log, cfg.train.steps, start, ctx.is_main)
    check = PlanCheck(run_dir, ctx.world_size, plan.dp, ctx.device) \
        if ctx.is_main and plan_check_enabled(cfg.log.plan_check, ctx.device) else None
    with StopRequest() as stop_request, contextlib.closing(log), \
            contextlib.closing(check) if check else contextlib.nullcontext(), \
            _parameter_server(cfg, ctx, plan, par, optimizer, start + 1) as ps:
        _announce(log, cfg, ctx, plan, described, data_dir, train_file, resume_from)
        if ctx.is_main:
            _record_nodes(log, run_dir, nodes, start)
        device_checks = DeviceChecks(ctx, ctx.device, _host_group(ctx)) if checks == "device" else None
        trainer = Trainer(cfg, ctx, par, optimizer, sched, scaler, sampler,
                          (train_file, val_file), log,
                          Task(arch, cfg.train.seed, cfg.model.vocab_size, cfg.data, ctx.device,
                               par.split_sequence if plan.cp > 1 else None),
                          execution_for(par, ps), first_step=start + 1, stop_request=stop_request,
                          step_flops=flops, plan_check=check, replay=replay,
                          save_group=_save_group(cfg, ctx),
                          checks=device_checks)
        try:
            for step in range(start + 1, cfg.train.steps + 1):
                trainer.step(step)
        except Stopped:  # every rank stops at the same step: the save in flight completes
            trainer.finish_save()
            raise
        trainer.finish_save()
    return 0


def _record_nodes(log, run_dir, nodes, start: int) -> None:
    """Rank 0: one line when the nodes differ from the run's last start (a node lost or
    regained under an elastic torchrun), then this start's nodes in run_dir/nodes.json."""
    line = membership.change_line(membership.read(run_dir), nodes, start)
    if line:
        log.info(line)
    warning = membership.shared_store_warning()
    if warning:
        log.info(warning)
    membership.write(run_dir, nodes, start)


def _save_group(cfg, ctx):
    """checkpoint.async_save under several processes: a gloo group of every rank for DCP's
    collectives in its writer thread (off the training collectives' group; gloo also when
    training runs on NCCL: async_save needs a CPU backend). In one process DCP's writer thread
    warns that it assumes one process, which is intended (the main thread's saves are quieted
    by checkpoint._quiet_single_process; a thread cannot be): that one warning is filtered."""
    if not cfg.checkpoint.async_save:
        return None
    if not ctx.distributed:
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        return None
    return dist.new_group(backend="gloo")


def _host_group(ctx):
    """train.step_checks=device under several processes: a gloo group of every rank for its
    per-step SIGTERM agreement between the hosts (step_checks.DeviceChecks.stop_agreed);
    None where the default group is gloo already."""
    if not ctx.distributed or ctx.backend == "gloo":
        return None
    return dist.new_group(backend="gloo")


def _routing_record(cfg):
    """moe.router_replay's record (trainer/router_record.py), or None."""
    if not cfg.moe.router_replay:
        return None
    from .router_record import RoutingRecord
    try:
        return RoutingRecord(cfg.moe.router_replay)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _init_from(cfg, ctx, par) -> None:
    """checkpoint.init_from: the model weights of another run (any layout), nothing else."""
    try:
        path = checkpoint.load_model_weights(cfg.checkpoint.init_from, par)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from!r}: {e}") from None
    if ctx.is_main:
        print(f"model weights from {path} (checkpoint.init_from); optimizer, schedule and data "
              f"start anew", flush=True)


@contextlib.contextmanager
def _parameter_server(cfg, ctx, plan, par, optimizer, first_step: int):
    """parallel.ps_servers > 0: host this rank's shard, start RPC, yield the worker's client
    (started from the model and optimizer as they are: fresh, or loaded from a checkpoint);
    None otherwise."""
    if not plan.ps_servers:
        yield None
        return
    from parallel.data_parallel import param_server
    client = param_server.start(par.model, optimizer, plan.ps_servers, plan.ps_staleness,
                                ctx.rank, ctx.world_size, param_server.default_init_method(),
                                per_expert=cfg.train.optimizer != "adafactor", first_step=first_step)
    try:
        yield client
    except BaseException:
        param_server.stop(ctx.rank, plan.ps_servers, graceful=False)
        raise
    param_server.stop(ctx.rank, plan.ps_servers)


def _describe(cfg, model) -> list:
    """The whole model's start-up lines (parameters, MoE layers, routing, forced balance)."""
    counts, layers = models.count_params(model), models.moe_layers(model)
    name = cfg.hf.family or cfg.model.arch
    if cfg.hf.config:
        from models.hf_sizes import read_hf_config
        name += f" ({read_hf_config(cfg.hf.config).get('model_type')} architecture of {cfg.hf.config})"
    depths = len(getattr(model, "mtp", None) or [])
    in_mtp = sum(n.startswith("mtp.") for n, _ in layers)
    mtp = f", {depths} MTP depth(s) ({in_mtp} of the MoE layers)" if depths else ""
    lines = [f"model: {name}, {counts['total'] / 1e6:.2f}M parameters, "
             f"{counts['active_per_token'] / 1e6:.2f}M active per token, {len(layers)} MoE layer(s){mtp}"]
    if layers:  # the routing semantics the run trains with (adopted models: from their config)
        lines.append(f"routing ({layers[0][0]}): {layers[0][1].routing_summary()}")
    forced = [layer for _, layer in layers if layer.force_balance]
    if forced:
        lines.append(f"WARNING: moe.force_balance=true in {len(forced)} MoE layer(s): routing is "
                     f"forced to an even spread (benchmarking only; losses are not a real model's)")
    return lines


def _announce(log, cfg, ctx, plan, described, data_dir, train_file, resume_from) -> None:
    log.info(f"moekit: {ctx.world_size} process(es) on {ctx.device.type}, layout {plan.summary()}")
    for line in described:
        log.info(line)
    if cfg.parallel.compile == "auto" and ctx.device.type == "cuda":  # a CPU run stays eager
        on, why = compile_choice(cfg)
        log.info(f"compile: {'on' if on else 'off'} (parallel.compile=auto: {why})")
    if cfg.moe.router_replay:
        log.info(f"router replay: training on the {train_file.num_sequences} recorded sequences of "
                 f"{cfg.data.seq_len} tokens in {cfg.moe.router_replay}, every MoE layer routing "
                 f"each token to its recorded experts (gates from the current router); "
                 f"validation: {data_dir}")
    else:
        log.info(f"data: {data_dir} ({train_file.num_sequences} training sequences of "
                 f"{cfg.data.seq_len} tokens)")
    if resume_from is not None:
        log.info(f"resumed from {resume_from}")
