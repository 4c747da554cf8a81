"""`python -m moe.profile`: expert-load profile of a train.py config's model on held-out data.

    python -m moe.profile --config CONFIG.toml [--checkpoint DIR] --out DIR [--batches N]
                          [section.field=value ...]

Builds the model exactly as train.py does (models.build_model, or moe.hf_build for an [hf]
section), loads the model weights of a checkpoint (a run dir: its latest complete
checkpoint; or one checkpoint dir), runs N validation batches of train.batch_size sequences
(the data split train.py evaluates on) and writes DIR/load.json, DIR/load.png and
DIR/tensorboard. Without --checkpoint it profiles the freshly initialised model.
"""
import argparse
import sys
import tomllib
from pathlib import Path

from .hf_build import HFConfig, build_hf_model
from .profile import profile_model


def _cli_value(raw: str):
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _hf_section(table: dict, overrides: list) -> HFConfig:
    known = set(HFConfig.__dataclass_fields__)
    values = dict(table)
    for item in overrides:
        key, _, raw = item.partition("=")
        values[key.split(".", 1)[1]] = _cli_value(raw)
    bad = sorted(set(values) - known)
    if bad:
        raise ValueError(f"unknown field(s) hf.{', hf.'.join(bad)}; [hf] has {sorted(known)}")
    return HFConfig(**values)


def load_run_config(path, overrides=()):
    """(trainer Config, HFConfig). The [hf] section is read here if the trainer's Config
    does not have one (so the profiler works with either)."""
    from trainer import config as tc
    data = tc.load_toml(path) if path else {}
    own_hf = "hf" not in tc.section_names()
    hf_table = data.pop("hf", {}) if own_hf else {}
    hf_over = [o for o in overrides if o.startswith("hf.")] if own_hf else []
    cfg = tc.Config()
    tc.apply_toml(cfg, data, str(path))
    for item in overrides:
        if item not in hf_over:
            tc.apply_override(cfg, item)
    hf = _hf_section(hf_table, hf_over) if own_hf else cfg.hf
    cfg.model.validate()
    cfg.moe.validate(cfg.model)   # also normalises capacity_factor 0 / "none" -> None
    hf.validate()
    return cfg, hf


def build_model(cfg, hf: HFConfig, device):
    """(model, task arch 'gpt' | 'switch') as train.py builds it, before any parallelism."""
    if hf.family:
        model = build_hf_model(hf, cfg.model, cfg.moe, cfg.train.seed, device)
        return model, model.task
    import models
    model = models.build_model(cfg.model, cfg.moe, device="meta")
    models.init_weights(model, cfg.train.seed, device)
    return model, cfg.model.arch


def load_checkpoint_weights(model, path) -> Path:
    """Model weights only, from a run dir (latest complete checkpoint) or a checkpoint dir."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from trainer import checkpoint
    path = Path(path)
    if (path / "checkpoints").is_dir():
        found = checkpoint.latest(path)
        if found is None:
            raise ValueError(f"{path}/checkpoints holds no complete checkpoint")
        path = Path(found)
    if not (path / "COMPLETE").is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no COMPLETE marker); pass a run "
                         f"dir or a checkpoints/step_XXXXXXXX dir")
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    return path


def validation_batches(cfg, arch: str, n_batches: int, device):
    """(batches of model inputs, tokenizer) from the validation split train.py uses."""
    from data.prepare import prepared_dir
    from data.sampler import eval_indices, open_split
    from data.tokenizer import load_tokenizer
    from trainer.tasks import Task
    data_dir = prepared_dir(cfg.data)
    val = open_split(data_dir, "val", cfg.data.seq_len)
    bs = cfg.train.batch_size
    idx = eval_indices(val.num_sequences, n_batches * bs, 0, 1)
    task = Task(arch, cfg.train.seed, cfg.model.vocab_size, cfg.data, device)

    def gen():
        for i in range(0, len(idx), bs):
            batch = task.prepare(val.batch(idx[i:i + bs]), idx[i:i + bs])
            yield ((batch["input_ids"], batch["decoder_input_ids"]) if arch == "switch"
                   else batch[:, :-1])
    return gen(), load_tokenizer(data_dir)


def print_summary(report: dict, out) -> None:
    print(f"{'layer':40s} {'imbal':>6s} {'cv':>6s} {'entropy':>12s} {'dropped':>8s}  dead", file=out)
    for r in report["layers"]:
        print(f"{r['name'][-40:]:40s} {r['imbalance']:6.2f} {r['cv']:6.2f} "
              f"{r['entropy']:5.2f}/{r['entropy_max']:<5.2f} {100 * r['dropped_fraction']:7.1f}%  "
              f"{r['dead_experts'] or '-'}", file=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe.profile", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="train.py TOML config")
    p.add_argument("--checkpoint", help="run dir or checkpoint dir to load model weights from")
    p.add_argument("--out", required=True, help="output dir for load.json, load.png, tensorboard/")
    p.add_argument("--batches", type=int, default=8, help="validation batches to run (default 8)")
    p.add_argument("--trace", action="store_true",
                   help="also time one training step with torch.profiler: OUT/trace.json + a printed breakdown")
    p.add_argument("overrides", nargs="*", help="section.field=value, as for train.py")
    args = p.parse_args(argv)
    import torch

    from trainer.config import ConfigError
    from trainer.distributed import choose_device
    try:
        if args.batches < 1:
            raise ValueError(f"--batches={args.batches} must be >= 1")
        cfg, hf = load_run_config(args.config, args.overrides)
        device = choose_device(cfg.run.device, 0)
        model, arch = build_model(cfg, hf, device)
        if args.checkpoint:
            print(f"weights: {load_checkpoint_weights(model, args.checkpoint)}")
        batches, tokenizer = validation_batches(cfg, arch, args.batches, device)
        with torch.no_grad():  # scoped: the CLI is also called in-process by tests
            report = profile_model(model, batches, args.out, tokenizer=tokenizer)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(report, sys.stdout)
    if args.trace:
        _trace(model, cfg, arch, device, args.out)
    print(f"wrote {args.out}/load.json, {args.out}/load.png, {args.out}/tensorboard")
    return 0


def _trace(model, cfg, arch, device, out_dir) -> None:
    """Forward + backward of one held-out batch with the training loss (+ aux), profiled."""
    from data.prepare import prepared_dir
    from data.sampler import eval_indices, open_split
    from trainer.tasks import Task

    from .aux import collect_aux_loss
    from .trace import print_breakdown, trace_step
    val = open_split(prepared_dir(cfg.data), "val", cfg.data.seq_len)
    idx = eval_indices(val.num_sequences, cfg.train.batch_size, 0, 1)
    task = Task(arch, cfg.train.seed, cfg.model.vocab_size, cfg.data, device)
    batch = task.prepare(val.batch(idx), idx)

    def step():
        model.train()
        model.zero_grad(set_to_none=True)
        loss = task.loss(model, batch)
        (loss + collect_aux_loss(model)).backward()
    print_breakdown(trace_step(step, out_dir), sys.stdout)
    print(f"wrote {out_dir}/trace.json")
