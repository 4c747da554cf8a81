"""`python -m trainer.profile`: expert-load profile of a train.py config's model on held-out data.

    python -m trainer.profile --config CONFIG.toml [--checkpoint DIR] --out DIR [--batches N]
                              [--nodes N] [section.field=value ...]

Builds the model exactly as train.py does (trainer/model.py), loads the model weights of a
checkpoint (a run dir: its latest complete checkpoint; or one checkpoint dir), runs N validation batches of train.batch_size sequences
(the data split train.py evaluates on) and writes DIR/load.json, DIR/load.png and
DIR/tensorboard. Without --checkpoint it profiles the freshly initialised model. Rows per
expert-parallel rank are planned for the config's parallel.ep and moe.replica_slots from each
batch's expert counts ("rank max/mean": without -> with replication). --nodes N declares that
the experts span N nodes (contiguous blocks of E/N): every MoE layer routes as it would on N
nodes (moe.max_nodes binds) and the profile reports nodes per token.
"""
import argparse
import dataclasses
import os
import sys

from moe.aux import moe_layers
from moe.profiling import profile_model

from trainer.config import ConfigError, check_sections, load_config
from trainer.model import build_one_process, task_arch


def load_run_config(path, overrides=()):
    """The trainer Config of a train.py config file plus overrides; its model, moe and hf
    sections checked as train.py does (the parallel layout does not matter here)."""
    cfg = load_config(path, overrides)
    check_sections(cfg)
    return cfg


def build_initialised(cfg, device):
    """(one-process Parallelized handle, task arch) of the model train.py would build."""
    return build_one_process(cfg, device), task_arch(cfg)


def validation_batches(cfg, arch: str, n_batches: int, device):
    """(batches of model inputs, tokenizer) from the validation split train.py uses."""
    from data.prepare import prepared_dir
    from data.sampler import open_split
    from data.tokenizer import load_tokenizer

    from trainer.evaluation import held_out
    from trainer.tasks import Task
    data_dir = prepared_dir(cfg.data)
    val = open_split(data_dir, "val", cfg.data.seq_len)
    task = Task(arch, cfg.train.seed, cfg.model.vocab_size, cfg.data, device)
    chunks = held_out(val, task, n_batches, cfg.train.batch_size)
    return (task.model_inputs(batch) for _, batch in chunks), load_tokenizer(data_dir)


def declare_expert_nodes(model, nodes: int) -> None:
    """Route every MoE layer of a one-process model as if its experts spanned `nodes` nodes:
    the routing half of MoELayer.set_expert_nodes, which needs an ep group to shard."""
    for name, layer in moe_layers(model):
        try:
            layer.router.config = dataclasses.replace(layer.router.config, expert_nodes=nodes)
        except ValueError as e:
            raise ValueError(f"--nodes={nodes} for layer {name}: {e}") from None


def print_summary(report: dict, out) -> None:
    print(f"{'layer':40s} {'imbal':>6s} {'cv':>6s} {'entropy':>12s} {'dropped':>8s} "
          f"{'rank max/mean':>15s}  dead", file=out)
    for r in report["layers"]:
        ranks = f"{r['rank_imbalance_unreplicated']:.2f}->{r['rank_imbalance']:.2f}"
        print(f"{r['name'][-40:]:40s} {r['imbalance']:6.2f} {r['cv']:6.2f} "
              f"{r['entropy']:5.2f}/{r['entropy_max']:<5.2f} {100 * r['dropped_fraction']:7.1f}% "
              f"{ranks:>15s}  {r['dead_experts'] or '-'}", file=out)
    if report.get("not_run"):
        print(f"not run by these forwards (no tokens to profile): {', '.join(report['not_run'])}",
              file=out)
    for r in report["layers"]:
        n = r["nodes_per_token"]
        if n is not None:
            print(f"{r['name'][-40:]:40s} nodes per token (of {n['expert_nodes']}, max_nodes="
                  f"{n['max_nodes']}): mean {n['mean']:.2f}, max {n['max']}, tokens reaching "
                  f"1..{n['expert_nodes']}: {n['tokens']}", file=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.profile", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="train.py TOML config")
    p.add_argument("--checkpoint", help="run dir or checkpoint dir to load model weights from")
    p.add_argument("--out", required=True, help="output dir for load.json, load.png, tensorboard/")
    p.add_argument("--batches", type=int, default=8, help="validation batches to run (default 8)")
    p.add_argument("--nodes", type=int, default=1,
                   help="nodes the experts span (contiguous blocks): route as on that many nodes "
                        "and report nodes per token (default 1)")
    p.add_argument("--trace", action="store_true",
                   help="also time one training step with torch.profiler: OUT/trace.json + a printed breakdown")
    p.add_argument("overrides", nargs="*", help="section.field=value, as for train.py")
    args = p.parse_args(argv)
    import torch

    from trainer.checkpoint import load_model_weights
    from trainer.distributed import choose_device
    try:
        if args.batches < 1:
            raise ValueError(f"--batches={args.batches} must be >= 1")
        if args.nodes < 1:
            raise ValueError(f"--nodes={args.nodes} must be >= 1")
        cfg = load_run_config(args.config, args.overrides)
        device = choose_device(cfg.run.device, 0)
        par, arch = build_initialised(cfg, device)
        if args.checkpoint:
            print(f"weights: {load_model_weights(args.checkpoint, par)}")
        if args.nodes > 1:
            declare_expert_nodes(par.model, args.nodes)
        batches, tokenizer = validation_batches(cfg, arch, args.batches, device)
        with torch.no_grad():  # scoped: the CLI is also called in-process by tests
            report = profile_model(par.model, batches, args.out, tokenizer=tokenizer,
                                   ep=(cfg.parallel.ep, cfg.moe.replica_slots))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(report, sys.stdout)
    if args.trace:
        _trace(par.model, cfg, arch, device, args.out)
    out = os.path.normpath(args.out)  # "prof/" gives prof/load.json, not prof//load.json
    print(f"wrote {os.path.join(out, 'load.json')}, {os.path.join(out, 'load.png')}, "
          f"{os.path.join(out, 'tensorboard')}")
    return 0


def _trace(model, cfg, arch, device, out_dir) -> None:
    """Forward + backward of one held-out batch with the training loss (+ aux), profiled."""
    from data.prepare import prepared_dir
    from data.sampler import open_split
    from moe.aux import collect_aux_loss
    from moe.profiling import print_breakdown, trace_step

    from trainer.evaluation import held_out
    from trainer.tasks import Task
    val = open_split(prepared_dir(cfg.data), "val", cfg.data.seq_len)
    task = Task(arch, cfg.train.seed, cfg.model.vocab_size, cfg.data, device)
    (_, batch), = held_out(val, task, 1, cfg.train.batch_size)

    def step():
        model.train()
        model.zero_grad(set_to_none=True)
        loss = task.loss(model, batch)
        (loss + collect_aux_loss(model)).backward()
    print_breakdown(trace_step(step, out_dir), sys.stdout)
    print(f"wrote {os.path.join(out_dir, 'trace.json')}")


if __name__ == "__main__":
    sys.exit(main())
