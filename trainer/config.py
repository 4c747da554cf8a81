"""The run configuration: one dataclass per concern, filled from defaults, then a TOML file,
then `section.field=value` command-line overrides (later wins).

Sections: run, model, moe, parallel, train, data, log, checkpoint, hf. Field help lives in each
dataclass field's metadata["help"]. Every mistake raises ConfigError naming the field and
the fix (unknown names get the closest valid one); train.py prints it without a traceback.
"""
import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from models.config import ModelConfig, MoEConfig
from models.hf_build import MOE_TASKS, TASKS as HF_TASKS, HFConfig, moe_section_conflicts
from parallel.plan import ParallelPlan

from .sections import CHOICES, CheckpointConfig, DataConfig, LogConfig, RunConfig, TrainConfig


class ConfigError(ValueError):
    """A user-facing configuration problem (printed without a traceback)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hf: HFConfig = field(default_factory=HFConfig)


SECTION_DOCS = {
    "run": "where the run lives and on which device",
    "model": "model architecture (models/config.py)",
    "moe": "Mixture-of-Experts layers (models/config.py)",
    "parallel": "parallel layout (parallel/plan.py); the product of degrees = world size",
    "train": "optimization",
    "data": "corpus, tokenizer and sequence length",
    "log": "metrics.jsonl, TensorBoard, progress display",
    "checkpoint": "torch.distributed.checkpoint saves in run.dir/checkpoints",
    "hf": "train a Hugging Face model family with MoE FFNs instead of model.arch (models/hf_build.py)",
}


def section_names() -> list:
    return [f.name for f in dataclasses.fields(Config)]


def _closest(name: str, options) -> str:
    near = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f"; did you mean {near[0]!r}?" if near else f"; valid names: {', '.join(options)}"


def _field_types(section) -> dict:
    return typing.get_type_hints(type(section))


def _is_optional(tp) -> tuple:
    """(True, inner type) for Optional[X] / X | None, else (False, tp)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return True, (args[0] if len(args) == 1 else typing.Union[tuple(args)])
    return False, tp


def _from_cli(raw: str):
    """A command-line value: TOML syntax when it parses (1, 0.5, true, "x", [1, 2]), else a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def coerce(value, tp, where: str):
    """Check/convert one value for a field of type `tp`; ConfigError naming `where` if wrong."""
    optional, tp = _is_optional(tp)
    if isinstance(value, str) and value.lower() in ("none", "null") and optional:
        return None
    if value is None and optional:
        return None
    if typing.get_origin(tp) is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}={value!r} is not one of {typing.get_args(tp)}")
        return value
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, (str, int, float)) and not isinstance(v, bool),
    }.get(tp)
    if ok is None:
        return value  # a type we do not police (lists, unions): the section's validate() does
    if not ok(value):
        hint = " (or none)" if optional else ""
        raise ConfigError(f"{where}={value!r} has the wrong type: expected {tp.__name__}{hint}")
    return tp(value) if tp in (float, str) else value


# names a field may also be given by (a Python keyword cannot name a dataclass field)
ALIASES = {("checkpoint", "async"): "async_save"}


def _set(cfg: Config, section: str, name: str, value, from_cli: bool) -> None:
    name = ALIASES.get((section, name), name)
    if section not in section_names():
        raise ConfigError(f"unknown config section {section!r}" + _closest(section, section_names()))
    sec = getattr(cfg, section)
    names = [f.name for f in dataclasses.fields(sec)]
    if name not in names:
        full = [f"{section}.{n}" for n in names] + [f"{s}.{n}" for s in section_names()
                                                   for n in _names(getattr(cfg, s))]
        raise ConfigError(f"unknown config field '{section}.{name}'" + _closest(f"{section}.{name}", full))
    tp = _field_types(sec)[name]
    if from_cli and isinstance(value, (int, float, bool)) and _is_optional(tp)[1] is str:
        value = str(value)
    value = coerce(value, tp, f"{section}.{name}")
    choices = CHOICES.get((section, name))
    if choices and value not in choices:
        raise ConfigError(f"{section}.{name}={value!r} is not supported; use one of {', '.join(choices)}")
    setattr(sec, name, value)


def _names(sec) -> list:
    return [f.name for f in dataclasses.fields(sec)]


def apply_toml(cfg: Config, data: dict, origin: str) -> None:
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{origin}: top-level key {section!r} must be a [section] table "
                              f"(e.g. [train] then steps = 100)" + _closest(section, section_names()))
        for name, value in table.items():
            _set(cfg, section, name, value, from_cli=False)


def load_toml(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; see configs/ for examples")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None


def apply_override(cfg: Config, item: str) -> None:
    key, eq, raw = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not eq or not dot or not name:
        raise ConfigError(f"override {item!r} must look like section.field=value "
                          f"(e.g. train.steps=100)")
    _set(cfg, section, name, _from_cli(raw.strip()), from_cli=True)


def load_config(path=None, overrides=()) -> Config:
    """Defaults, then the TOML file, then the overrides. With hf.config set, the sizes its
    config.json gives (models/hf_sizes.py) come first and the TOML and overrides again on top
    (what a user sets wins)."""
    data = load_toml(path) if path is not None else {}
    cfg = _layered(Config(), data, path, overrides)
    if cfg.hf.config:
        hf_path = _hf_config_path(cfg.hf.config, path)
        base = Config()
        for section, table in _hf_sizes(hf_path).items():
            for name, value in table.items():
                setattr(getattr(base, section), name, value)
        cfg = _layered(base, data, path, overrides)
        cfg.hf.config = hf_path
    return cfg


def _layered(cfg: Config, data: dict, path, overrides) -> Config:
    if path is not None:
        apply_toml(cfg, data, str(path))
    if not cfg.run.name:  # auto run directories are named after the config file
        cfg.run.name = Path(path).stem if path is not None else "default"
    for item in overrides:
        apply_override(cfg, item)
    return cfg


def _hf_config_path(value: str, toml_path) -> str:
    """hf.config as given, or relative to the TOML file's folder when it is found there."""
    p = Path(value)
    if not p.is_absolute() and not p.exists() and toml_path is not None:
        beside = Path(toml_path).parent / p
        if beside.exists():
            return str(beside)
    return value


def _hf_sizes(value: str) -> dict:
    from models.hf_sizes import gpt_sections, read_hf_config
    try:
        return gpt_sections(read_hf_config(value), f"hf.config={value!r}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except KeyError as e:  # a key every config.json of the family has
        raise ConfigError(f"hf.config={value!r} has no {e.args[0]!r}, which its model_type's "
                          f"config.json always holds; use the model's complete config.json") from None


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as a TOML file that load_config reads back (None -> "none")."""
    lines = []
    for section, table in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for name, value in table.items():
            lines.append(f"{name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v) -> str:
    if v is None:
        return '"none"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def help_text() -> str:
    cfg, out = Config(), []
    for section in section_names():
        sec = getattr(cfg, section)
        out.append(f"[{section}]  {SECTION_DOCS.get(section, '')}")
        types_ = _field_types(sec)
        for f in dataclasses.fields(sec):
            tp = types_[f.name]
            tname = getattr(tp, "__name__", str(tp).replace("typing.", ""))
            default = _toml_value(getattr(sec, f.name))
            out.append(f"  {section}.{f.name} ({tname}, default {default})")
            out.append(f"      {f.metadata.get('help', '')}")
        out.append("")
    return "\n".join(out)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_own(cfg: Config) -> None:
    t, d, lg, ck = cfg.train, cfg.data, cfg.log, cfg.checkpoint
    _require(cfg.run.dir != "", "run.dir='' is empty; give a directory, or run.dir=auto for a new "
                                "runs/<run.name>-NNN")
    _require(cfg.run.name == "" or ("/" not in cfg.run.name and "\\" not in cfg.run.name
                                    and cfg.run.name not in (".", "..")),
             f"run.name={cfg.run.name!r} must be a plain name (it names runs/<run.name>-NNN); "
             f"to choose the directory itself set run.dir")
    _require(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    _require(cfg.run.hang_timeout_s >= 0, f"run.hang_timeout_s={cfg.run.hang_timeout_s} must be "
                                          f">= 0 seconds (0 = no hang detection)")
    _require(lg.peak_tflops >= 0, f"log.peak_tflops={lg.peak_tflops} must be >= 0 (0 = a known "
                                  f"GPU's data-sheet peak, or no mfu)")
    _require(t.batch_size >= 1, f"train.batch_size={t.batch_size} must be >= 1 (global sequences per step)")
    _require(t.micro_batch_size >= 0, f"train.micro_batch_size={t.micro_batch_size} must be >= 0 (0 = no accumulation)")
    _require(t.lr > 0, f"train.lr={t.lr} must be > 0")
    _require(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    _require(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be >= 0")
    _require(t.loss_scale_init >= 1, f"train.loss_scale_init={t.loss_scale_init} must be >= 1")
    _require(t.max_skipped_steps >= 0, f"train.max_skipped_steps={t.max_skipped_steps} must be >= 0 (0 = never stop)")
    _require(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 = off)")
    _require(t.eval_every >= 0 and t.eval_batches >= 1,
             "train.eval_every must be >= 0 and train.eval_batches >= 1")
    _require(d.seq_len >= 2, f"data.seq_len={d.seq_len} must be >= 2")
    max_len = getattr(cfg.model, "max_seq_len", None)
    _require(max_len is None or d.seq_len <= max_len,
             f"data.seq_len={d.seq_len} is longer than model.max_seq_len={max_len}; "
             f"lower data.seq_len or raise model.max_seq_len")
    _require(lg.every >= 1, f"log.every={lg.every} must be >= 1")
    _require(lg.moe_stats_every >= 0, f"log.moe_stats_every={lg.moe_stats_every} must be >= 0")
    _require(lg.profile_every >= 0, f"log.profile_every={lg.profile_every} must be >= 0")
    _require(lg.peak_mem_every >= 0, f"log.peak_mem_every={lg.peak_mem_every} must be >= 0 (0 = auto)")
    _require(lg.plan_check in ("auto", "on", "off"), f"log.plan_check={lg.plan_check!r} must be auto, on or off")
    _require(lg.profile_batches >= 1, f"log.profile_batches={lg.profile_batches} must be >= 1")
    _require(ck.every >= 0, f"checkpoint.every={ck.every} must be >= 0 (0 = only at the end)")
    _require(ck.keep >= 1, f"checkpoint.keep={ck.keep} must be >= 1")
    _check_ranges(cfg)


def _check_ranges(cfg: Config) -> None:
    """The numeric fields torch, the data pipeline or the launcher would otherwise reject deep
    inside a run (a traceback) or take silently: one line each, naming the field."""
    t, d = cfg.train, cfg.data
    _require(cfg.run.dist_timeout_s >= 1, f"run.dist_timeout_s={cfg.run.dist_timeout_s} must be "
                                          f">= 1 second (the process group's collective timeout)")
    _require(t.seed >= 0, f"train.seed={t.seed} must be >= 0")
    for name in ("beta1", "beta2", "muon_momentum"):
        v = getattr(t, name)
        _require(0 <= v < 1, f"train.{name}={v} must be in [0, 1)")
    _require(t.eps > 0, f"train.eps={t.eps} must be > 0")
    _require(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay} must be >= 0")
    _require(t.muon_ns_steps >= 1, f"train.muon_ns_steps={t.muon_ns_steps} must be >= 1")
    _require(d.vocab_size >= 1, f"data.vocab_size={d.vocab_size} must be >= 1 (the BPE vocabulary)")
    _require(0 <= d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    _require(d.max_bytes >= 0, f"data.max_bytes={d.max_bytes} must be >= 0 (0 = all)")
    _require(0 < d.noise_density < 1, f"data.noise_density={d.noise_density} must be in (0, 1)")
    _require(d.mean_span_length >= 1, f"data.mean_span_length={d.mean_span_length} must be >= 1 token")
    _require(cfg.moe.swiglu_alpha > 0, f"moe.swiglu_alpha={cfg.moe.swiglu_alpha} must be > 0")


def step_checks_blocker(cfg: Config, plan) -> str:
    """Why train.step_checks=device cannot run this config ('' when it can): the skip it
    decides on the device goes through fused AdamW's found_inf in one plain step."""
    t = cfg.train
    for why, bad in ((f"train.optimizer={t.optimizer!r} (set train.optimizer='adamw')", t.optimizer != "adamw"),
                     (f"train.optimizer_impl={t.optimizer_impl!r} (set 'fused' or 'auto')",
                      t.optimizer_impl not in ("auto", "fused")),
                     ("parallel.precision='fp16' (its loss scaler reads overflows on the host)",
                      plan.precision == "fp16"),
                     (f"parallel.pp={plan.pp} (the pipeline schedule steps on the host; set pp=1)", plan.pp > 1),
                     (f"parallel.ps_servers={plan.ps_servers} (the servers step; set 0)", plan.ps_servers > 0),
                     (f"parallel.offload={plan.offload!r} (a host-resident step; set 'none')", plan.offload != "none")):
        if bad:
            return why
    return ""


def _check_optimizer(cfg: Config, plan) -> None:
    if cfg.train.step_checks == "device":
        why = step_checks_blocker(cfg, plan)
        _require(not why, f"train.step_checks='device' cannot run with {why}; "
                          f"or set train.step_checks='host'")
    impl = cfg.train.optimizer_impl
    _require(impl == "auto" or cfg.train.optimizer == "adamw",
             f"train.optimizer_impl={impl!r} picks torch AdamW's implementation; with "
             f"train.optimizer={cfg.train.optimizer!r} set train.optimizer_impl='auto'")
    if cfg.train.optimizer == "muon":
        _check_muon(cfg, plan)
    _require(not (cfg.train.optimizer == "adafactor" and plan.zero in (1, 2)),
             f"train.optimizer='adafactor' cannot run on ZeRO-{plan.zero}'s flat parameter slices "
             f"(its factored moments need the matrix shapes); use parallel.zero=3 (its shards keep "
             f"the shapes) or 0, or train.optimizer='adamw'")


def _check_muon(cfg: Config, plan) -> None:
    """Muon orthogonalises whole matrices: ZeRO-1/2/3, tensor parallelism (1-D and the grids)
    and expert tensor parallelism, alone or composed, hold pieces that parallel/muon.py sends
    to an owner rank; these layouts are not handled by it."""
    whole = "(dp, cp, pp, ep, tp of every tp_mode and etp, with ZeRO-1/2/3, offload and hpZ, are handled)"
    _require(plan.ps_servers == 0, f"train.optimizer='muon' with parallel.ps_servers={plan.ps_servers}: "
             f"the parameter server steps the optimizer itself, on its servers' pieces, which the "
             f"gathered Muon update does not handle; set parallel.ps_servers=0 {whole}")
    _require(plan.pp_schedule != "2bw", "train.optimizer='muon' with parallel.pp_schedule='2bw': "
             "PipeDream-2BW keeps two weight versions its own way; use another pp_schedule")
    _require(cfg.train.muon_ns_steps >= 1 and cfg.train.muon_momentum >= 0,
             f"train.muon_ns_steps={cfg.train.muon_ns_steps} must be >= 1 and "
             f"train.muon_momentum={cfg.train.muon_momentum} >= 0")


def _check_batching(cfg: Config, plan) -> None:
    local = cfg.train.batch_size // plan.dp
    mb = cfg.train.micro_batch_size
    if plan.pp > 1:
        _require(cfg.log.profile_every == 0 or cfg.moe.every == 0,
                 f"log.profile_every={cfg.log.profile_every} is not supported with parallel.pp={plan.pp} "
                 f"(a stage does not hold the whole model): set log.profile_every=0 and profile a "
                 f"checkpoint with `python -m trainer.profile --checkpoint`")
        _require(mb == 0, f"train.micro_batch_size={mb} cannot be combined with parallel.pp={plan.pp}: "
                          f"the pipeline splits batches itself; set parallel.microbatches instead")
    elif mb:
        _require(local % mb == 0,
                 f"train.micro_batch_size={mb} does not divide the per-rank batch {local} "
                 f"(train.batch_size / dp = {cfg.train.batch_size} / {plan.dp}); pick a divisor of {local}")
    if plan.a2a_overlap == "1f1b":
        n = local // mb if mb else 1
        _require(plan.pp > 1 or n >= 2, f"parallel.a2a_overlap=1f1b runs one micro-batch's forward beside another's "
                         f"backward, but train.micro_batch_size={mb} gives {n} micro-batch per step; "
                         f"set train.micro_batch_size to a divisor of {local} below it")
        _require(not cfg.moe.router_replay, "parallel.a2a_overlap=1f1b with moe.router_replay: the "
                                            "replayed ids are set per micro-batch on the model; use one")


def check_hf_layout(cfg: Config, plan) -> None:
    """Hugging Face families run data/expert parallelism and ZeRO only."""
    _require(not cfg.hf.family or (plan.tp, plan.pp, plan.cp) == (1, 1, 1),
             "hf.family models support data/expert parallelism and ZeRO only; "
             "set parallel.tp=1, parallel.pp=1 and parallel.cp=1")
    _require(not cfg.hf.family or plan.recompute != "selective",
             f"parallel.recompute=selective names the parts of moekit's own blocks; the "
             f"hf.family={cfg.hf.family} model's layers are not those: use parallel.recompute=full")


def check_sections(cfg: Config) -> None:
    """The model, moe and hf sections, checked one way for train.py, the planner and the
    profiler: moe against the model (it must place an MoE block; capacity_factor 0 / "none"
    normalised to None), and an adopted hf MoE model's [moe] section left at its defaults."""
    try:
        cfg.model.validate()
        cfg.moe.validate(cfg.model)
        cfg.hf.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.hf.family in MOE_TASKS:
        ignored = moe_section_conflicts(cfg.moe, cfg.model)
        _require(not ignored, f"moe.{', moe.'.join(ignored)} set, but hf.family={cfg.hf.family!r} "
                              f"takes its routing from hf.pretrained's config; remove "
                              f"{'them' if len(ignored) > 1 else 'it'} from the [moe] section")


def task_arch(cfg: Config) -> str:
    """'gpt' (next-token) or 'switch' (span corruption): the training task of the model."""
    return HF_TASKS[cfg.hf.family] if cfg.hf.family else cfg.model.arch


def _check_mtp(cfg: Config) -> None:
    d = cfg.model.mtp_depth
    _require(not (d and cfg.hf.family),
             f"model.mtp_depth={d} builds moekit's own GPT's MTP depths; hf.family={cfg.hf.family!r} "
             f"trains a transformers model, which has none: set model.mtp_depth=0 or drop hf.family")
    _require(not (d and cfg.moe.router_replay),
             f"model.mtp_depth={d} with moe.router_replay: the recorded routes cover the main "
             f"model's MoE layers, the MTP depths' have none; set model.mtp_depth=0 or drop "
             f"moe.router_replay")


def _check_hf_weights(cfg: Config) -> None:
    if not cfg.hf.weights:
        return
    from models.hf_sizes import read_hf_config
    family = read_hf_config(cfg.hf.config).get("model_type")
    _require(family == "deepseek_v3",
             f"hf.weights reads DeepSeek-V3-family checkpoints (hf.config of model_type "
             f"deepseek_v3), not {family!r}; remove hf.weights to start from a fresh init")


def _check_replay(cfg: Config, plan) -> None:
    """moe.router_replay: layouts whose MoE layers see whole sequences of this rank's rows."""
    if not cfg.moe.router_replay:
        return
    where = f"moe.router_replay={cfg.moe.router_replay!r}"
    _require(cfg.moe.every > 0, f"{where} on a dense model (moe.every=0); unset it")
    _require(task_arch(cfg) == "gpt", f"{where} replays decoder-only models (records come from "
             f"trainer.generate's causal decode); unset it for this encoder-decoder")
    _require(cfg.moe.router == "token_choice" and not cfg.moe.force_balance,
             f"{where} needs moe.router='token_choice' and moe.force_balance=false (the replayed "
             f"experts are token choices)")
    for name, value, off in (("pp", plan.pp, 1), ("cp", plan.cp, 1), ("tp", plan.tp, 1),
                             ("ps_servers", plan.ps_servers, 0)):
        _require(value == off, f"{where} runs with data and expert parallelism (and ZeRO); "
                               f"set parallel.{name}={off}")


def compile_choice(cfg: Config) -> tuple:
    """(compile on, why) for this run: parallel.compile as set, or auto's decision for the
    device run.device resolves to (parallel/compile.py auto_compile)."""
    value = cfg.parallel.compile
    if value != "auto":
        return value, f"parallel.compile={str(value).lower()}"
    from parallel.compile import auto_compile
    return auto_compile(cfg.parallel, run_device_type(cfg), bool(cfg.hf.family))


def run_device_type(cfg: Config) -> str:
    """The device type run.device resolves to ('cuda' or 'cpu')."""
    from parallel.mesh import default_device_type
    return default_device_type() if cfg.run.device == "auto" else cfg.run.device


def _check_fp8_kernels(cfg: Config, plan) -> None:
    """precision=fp8 on a GPU whose FP8 GEMMs would be emulated is refused: it trains slower
    than bf16 (issue 60). A CPU keeps the emulation: the reference the tests run."""
    if plan.precision != "fp8" or run_device_type(cfg) != "cuda":
        return
    import torch
    from moe.fp8 import device_fp8_kernels, emulated_gemms
    kernels = device_fp8_kernels(torch.device("cuda", torch.cuda.current_device()))
    slow = emulated_gemms(kernels, plan.fp8_recipe)
    fix = ("set parallel.fp8_recipe=rowwise (SM90+), install deep_gemm (SM90+) for the blockwise "
           "banks, or set parallel.precision=bf16" if plan.fp8_recipe != "rowwise" else
           "set parallel.precision=bf16")
    _require(not slow, f"parallel.precision=fp8 on this GPU would run {' and '.join(slow)} as "
                       f"an emulation, slower than bf16; {fix}")


def validate(cfg: Config, world_size: int):
    """Check every section and their combination; returns the resolved ParallelPlan
    (parallel.compile=auto decided for the run's device)."""
    _check_own(cfg)
    check_sections(cfg)
    try:
        parallel = dataclasses.replace(cfg.parallel, compile=compile_choice(cfg)[0])
        plan = parallel.validate(world_size, cfg.model, cfg.moe, cfg.train.batch_size,
                                 cfg.data.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_hf_layout(cfg, plan)
    _check_mtp(cfg)
    _check_hf_weights(cfg)
    _check_replay(cfg, plan)
    _check_batching(cfg, plan)
    _check_optimizer(cfg, plan)
    _check_fp8_kernels(cfg, plan)
    return plan
