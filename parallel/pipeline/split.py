"""The pipeline split: prune a model to this rank's stages and pick the runner.

Stage k of n (n = pp * stages_per_rank) holds the contiguous blocks parallel.pp_layers gives
it (layers.py: even, explicit or balanced); stage 0 also the embeddings, the last stage the
final norm and lm_head; which stages a rank runs is the
schedule's placement (schedules.py).

The model object is pruned in place to this rank's parts, keeping parameter names
(blocks.5.attn.wq.weight stays blocks.5...), so checkpoints move between layouts. With more
than one stage per rank, each stage runs through a shallow "shell" of the model that shares
its submodules. Every stage's MoE aux losses reach backward: each MoE layer's output is
wrapped so its backward also starts the aux loss's backward (moe.aux.inject_aux_loss),
because only the last stage sees the task loss.
"""
import copy

import torch.nn as nn

from moe.aux import inject_aux_loss

from .layers import stage_blocks
from .runner import PipelineRunner
from .schedules import SCHEDULES
from .twobw import TwoBWRunner


def _keep_blocks(blocks: nn.ModuleList, keep: list) -> nn.ModuleList:
    """A ModuleList holding only `keep` indices, under their original names."""
    out = nn.ModuleList()
    for i in keep:
        out._modules[str(i)] = blocks[i]
    return out


def _shell(model, stage: int, num_stages: int, blocks: list):
    shell = copy.copy(model)  # shares submodules, parameters and hooks of the pruned model
    shell._modules = dict(model._modules)
    shell.blocks = _keep_blocks(model.blocks, blocks)
    if stage != 0:
        shell.tok_emb, shell.pos_emb = None, None
    if stage != num_stages - 1:
        shell.norm, shell.lm_head = None, None
    return shell


def split_pipeline(model, plan, meshes, loss_fn, baton=None):
    """Prune `model` to this pp rank's stages; return a PipelineRunner (schedule built
    lazily; `baton`: parallel.a2a_overlap=1f1b, its forward/backward pairs interleaved)."""
    if loss_fn is None:
        raise ValueError("pipeline parallelism needs loss_fn(logits, targets) passed to parallelize")
    n_layers, n = len(model.blocks), plan.num_stages  # (MTP depths: refused under pp)
    stages = plan.stages_of(meshes.pp_rank)
    layers = stage_blocks(plan.pp_layers, n_layers, n)
    per_stage = {s: layers[s] for s in stages}
    chunks = [_shell(model, s, n, per_stage[s]) for s in stages]
    keep = sorted(i for s in stages for i in per_stage[s])
    model.blocks = _keep_blocks(model.blocks, keep)
    if 0 not in stages:
        model.tok_emb, model.pos_emb = None, None
    if n - 1 not in stages:
        model.norm, model.lm_head = None, None
    if len(chunks) == 1:
        chunks = [model]  # the pruned model itself is the stage (FSDP2 root hooks fire)
    stage_mtp = _keep_mtp_on_last(model, chunks, stages, n, loss_fn)
    if stage_mtp is not None:
        loss_fn = stage_mtp.loss
    inject_aux_loss(model)
    runner = TwoBWRunner if SCHEDULES[plan.pp_schedule].asynchronous else PipelineRunner
    out = runner(plan, meshes, model, chunks, stages, loss_fn, baton)
    out.mtp = stage_mtp
    return out


def _keep_mtp_on_last(model, chunks, stages, n: int, loss_fn):
    """The MTP depths on the last stage only (parallel/pipeline/mtp.py), or None."""
    if getattr(model, "mtp", None) is None:
        return None
    last = chunks[stages.index(n - 1)] if n - 1 in stages else None
    for chunk in chunks:
        if chunk is not last:
            chunk.mtp = None  # (a shell's modules dict is its own)
    if last is None:
        model.mtp = None  # not this rank's parameters
        return None
    from .mtp import StageMTP
    return StageMTP(last, loss_fn, last.model_cfg.mtp_loss_coef, len(last.mtp))
