"""Pipeline parallelism for the GPT of models/: stages from contiguous blocks, run by the
torch.distributed.pipelining schedules (GPipe, 1F1B, interleaved 1F1B).

Shapes: B per-rank batch, b microbatch, S sequence, D model dim.
Stage k of n (n = pp * stages_per_rank) holds blocks [k*L/n, (k+1)*L/n); stage 0 also the
embeddings, the last stage the final norm and lm_head. Pipeline rank r runs stages
r, r+pp, ... (looped placement, what the interleaved schedule expects).

The model object is pruned in place to this rank's parts, keeping parameter names
(blocks.5.attn.wq.weight stays blocks.5...), so checkpoints move between layouts. With more
than one stage per rank, each stage runs through a shallow "shell" of the model that shares
its submodules. Every stage's MoE aux losses reach backward: each MoE layer's output is
wrapped so its backward also starts the aux loss's backward (moe.aux.inject_aux_loss),
because only the last stage sees the task loss.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from moe import MoELayer
from moe.aux import inject_aux_loss

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def _keep_blocks(blocks: nn.ModuleList, keep: list) -> nn.ModuleList:
    """A ModuleList holding only `keep` indices, under their original names."""
    out = nn.ModuleList()
    for i in keep:
        out._modules[str(i)] = blocks[i]
    return out


def _stage_ids(plan, pp_rank: int) -> list:
    return [pp_rank + k * plan.pp for k in range(plan.stages_per_rank)]


def _layers_of(stage: int, n_layers: int, num_stages: int) -> list:
    per = n_layers // num_stages
    return list(range(stage * per, (stage + 1) * per))


def _shell(model, stage: int, num_stages: int, blocks: list):
    shell = copy.copy(model)  # shares submodules, parameters and hooks of the pruned model
    shell._modules = dict(model._modules)
    shell.blocks = _keep_blocks(model.blocks, blocks)
    if stage != 0:
        shell.tok_emb, shell.pos_emb = None, None
    if stage != num_stages - 1:
        shell.norm, shell.lm_head = None, None
    return shell


def split_pipeline(model, plan, meshes, loss_fn):
    """Prune `model` to this pp rank's stages; return a PipelineRunner (schedule built lazily)."""
    if loss_fn is None:
        raise ValueError("pipeline parallelism needs loss_fn(logits, targets) passed to parallelize")
    if model.lm_head is not None and model.tok_emb is not None and model.lm_head.weight is model.tok_emb.weight:
        raise ValueError("model.tie_embeddings=true cannot be split across pipeline stages (first "
                         "and last stage would share a weight); set model.tie_embeddings=false")
    n_layers, n = len(model.blocks), plan.num_stages
    stages = _stage_ids(plan, meshes.pp_rank)
    per_stage = {s: _layers_of(s, n_layers, n) for s in stages}
    chunks = [_shell(model, s, n, per_stage[s]) for s in stages]
    keep = sorted(i for s in stages for i in per_stage[s])
    model.blocks = _keep_blocks(model.blocks, keep)
    if 0 not in stages:
        model.tok_emb, model.pos_emb = None, None
    if n - 1 not in stages:
        model.norm, model.lm_head = None, None
    if len(chunks) == 1:
        chunks = [model]  # the pruned model itself is the stage (FSDP2 root hooks fire)
    inject_aux_loss(model)
    return PipelineRunner(plan, meshes, model, chunks, stages, loss_fn)


class PipelineRunner:
    """One optimizer step's forward+backward over microbatches: `loss = runner.step(x, y)`.

    x (token ids) is used on the first stage, y (targets) on the last; every pp rank gets the
    same returned loss: mean task loss over microbatches plus every MoE layer's aux loss
    averaged over microbatches (what one process reports for the whole batch).
    Gradients are left reduced over dp/edp/pool and divided by the microbatch count.
    `runner.stage_aux_loss()` is this rank's part of that aux loss (before the pp sum);
    `runner.evaluate(x, y)` is the forward-only mean task loss, on every pp rank.
    """

    def __init__(self, plan, meshes, model, chunks, stage_ids, loss_fn):
        self.plan, self.meshes, self.model = plan, meshes, model
        self.chunks, self.stage_ids, self.loss_fn = chunks, stage_ids, loss_fn
        self.schedule, self.eval_schedule, self._aux = None, None, []
        self._stage_aux = torch.zeros(())
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.register_forward_hook(self._record_aux)

    def _record_aux(self, mod, _args, _out):
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self._aux.append(mod.aux_loss.detach())

    def _build(self):
        from torch.distributed import pipelining
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        group = self.meshes.group("pp")
        stages = [pipelining.PipelineStage(c, s, self.plan.num_stages, device, group=group)
                  for c, s in zip(self.chunks, self.stage_ids)]
        cls = getattr(pipelining, SCHEDULES[self.plan.pp_schedule])
        arg = stages if self.plan.pp_schedule == "interleaved_1f1b" else stages[0]
        return cls(arg, n_microbatches=self.plan.microbatches, loss_fn=self.loss_fn)

    def step(self, x_BS, y_BS):
        if self.schedule is None:
            self.schedule = self._build()
        self._aux.clear()
        state = getattr(self.model, "moekit_parallel", None)
        grad_sync = state.grad_sync if state is not None else None
        if grad_sync is not None:  # one reduction after all microbatches, not one per backward
            grad_sync.enabled = False
        losses = []
        first, last = 0 in self.stage_ids, self.plan.num_stages - 1 in self.stage_ids
        self.schedule.step(*((x_BS,) if first else ()), target=y_BS if last else None, losses=losses)
        if grad_sync is not None:
            grad_sync.enabled = True
            grad_sync.sync()
        return self._total_loss(losses, last)

    def _total_loss(self, losses, last):
        mb = self.plan.microbatches
        task = torch.stack([l.detach().float() for l in losses]).mean() if last and losses else torch.zeros(())
        # the last mb * layers records: the first step also runs a shape-inference forward
        n = mb * sum(isinstance(m, MoELayer) for m in self.model.modules())
        aux = torch.stack([a.float() for a in self._aux[-n:]]).sum() / mb if n else torch.zeros(())
        self._stage_aux = aux  # kept apart from _aux, which later (eval) forwards append to
        total = (task + aux).reshape(1)
        dist.all_reduce(total, group=self.meshes.group("pp"))
        return total[0]


    def stage_aux_loss(self) -> torch.Tensor:
        """The aux loss of this rank's MoE layers in the last step(), averaged over
        microbatches; summing it over the pp group gives the aux part of step()'s loss."""
        return self._stage_aux

    def evaluate(self, x_BS, y_BS) -> torch.Tensor:
        """Forward-only mean task loss over microbatches (equal-sized, so the batch mean),
        returned on every pp rank. The model's train/eval mode is the caller's.

        A schedule of its own, always run forward-only: sharing the training schedule would
        redo its shape inference (a real forward) at every train/eval switch.
        """
        if self.eval_schedule is None:
            self.eval_schedule = self._build()
        losses = []
        first, last = 0 in self.stage_ids, self.plan.num_stages - 1 in self.stage_ids
        with torch.no_grad():
            self.eval_schedule.eval(*((x_BS,) if first else ()), target=y_BS if last else None,
                                    losses=losses)
        task = torch.stack([l.float() for l in losses]).mean() if last and losses else torch.zeros(())
        task = task.reshape(1).to(x_BS.device)
        dist.all_reduce(task, group=self.meshes.group("pp"))
        return task[0]
