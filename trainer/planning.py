"""A train.py config as the planner's Workload: the model built on the meta device, the
tokens per stream, and train.py's own validation as the check of every candidate layout.
Used by `python -m parallel.planner` (commands/plan.py), the benches and the tests."""
import copy
import dataclasses

import torch

from models.blocks import blocks
from parallel.compile import auto_compile
from parallel.planner.workload import Workload

from .config import validate
from .model import build_model, task_arch


def stream_tokens(cfg) -> dict:
    """Tokens per sequence of each stack: seq_len (decoder-only), or the span-corrupted
    encoder input and decoder target lengths of a seq_len+1 sample (encoder-decoder)."""
    if task_arch(cfg) != "switch":
        return {"decoder": cfg.data.seq_len}
    from data.span_corruption import corrupted_lengths
    enc, dec = corrupted_lengths(cfg.data.seq_len + 1, cfg.data.noise_density,
                                 cfg.data.mean_span_length)
    return {"encoder": enc, "decoder": dec}


def workload_from_config(cfg, imbalance: float = 1.0, nodes_per_token: float = 0.0) -> Workload:
    template = build_model(cfg, torch.device("meta"))  # hf families: tiny configs, on CPU

    def build():  # a fresh copy per layout: parallelize changes the model in place
        return copy.deepcopy(template)

    def build_stage(block_ids):  # a pipeline rank prunes the other blocks without touching them
        keep = set(block_ids)
        shared = {id(b): b for i, b in enumerate(blocks(template)) if i not in keep}
        return copy.deepcopy(template, shared)

    def check(plan, world):  # train.py's whole validation, with this layout; compile=auto as
        if plan.compile == "auto":  # a CUDA run decides it (the planner plans GPU runs), not this host
            plan = dataclasses.replace(plan, compile=auto_compile(plan, "cuda", bool(cfg.hf.family))[0])
        return validate(dataclasses.replace(cfg, parallel=plan), world)

    return Workload(build, cfg.model, cfg.moe, cfg.train.batch_size, stream_tokens(cfg),
                    cfg.train.micro_batch_size, cfg.train.optimizer, imbalance, check,
                    build_stage if task_arch(cfg) == "gpt" and not cfg.hf.family else None,
                    nodes_per_token)
