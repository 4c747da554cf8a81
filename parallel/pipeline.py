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

Tied embeddings (Megatron's scheme): the first stage holds the token embedding, the last the
output head, both the same [V, D] matrix. TiedEmbedding makes them start identical (a
broadcast from the first stage after init), sums their gradients over the two holders
before the optimizer step, counts the norm once, and names the weight once in checkpoints.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from moe import MoELayer
from moe.aux import inject_aux_loss

from .dtensors import local
from .plan import ASYNC_SCHEDULES, MULTI_STAGE_SCHEDULES, V_SCHEDULES

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "zb_interleaved": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
             "dualpipev": "ScheduleDualPipeV"}


def _keep_blocks(blocks: nn.ModuleList, keep: list) -> nn.ModuleList:
    """A ModuleList holding only `keep` indices, under their original names."""
    out = nn.ModuleList()
    for i in keep:
        out._modules[str(i)] = blocks[i]
    return out


def _stage_ids(plan, pp_rank: int) -> list:
    """Looped placement (r, r+pp, ...), or the V of zbv/dualpipev: r and 2pp-1-r, so the
    last stage sits on rank 0 beside the first."""
    if plan.pp_schedule in V_SCHEDULES:
        return [pp_rank, 2 * plan.pp - 1 - pp_rank]
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
    if plan.pp_schedule in ASYNC_SCHEDULES:
        from .pipedream import TwoBWRunner
        return TwoBWRunner(plan, meshes, model, chunks, stages, loss_fn)
    return PipelineRunner(plan, meshes, model, chunks, stages, loss_fn)


class PipelineRunner:
    """One optimizer step's forward+backward over microbatches: `loss = runner.step(x, y)`.

    x (token ids) is used on the first stage, y (targets) on the last; every pp rank gets the
    same returned loss: mean task loss over microbatches plus every MoE layer's aux loss
    averaged over microbatches (what one process reports for the whole batch).
    Gradients are left unreduced over dp/edp/pool, divided by the microbatch count.
    `runner.stage_aux_loss()` is this rank's part of that aux loss (before the pp sum);
    `runner.evaluate(x, y)` is the forward-only mean task loss, on every pp rank.
    """

    has_grads = True  # step() leaves a gradient to reduce and apply (2bw's first does not)

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
        device = local(next(self.model.parameters())).device
        group = self.meshes.group("pp")
        stages = [pipelining.PipelineStage(c, s, self.plan.num_stages, device, group=group)
                  for c, s in zip(self.chunks, self.stage_ids)]
        cls = getattr(pipelining, SCHEDULES[self.plan.pp_schedule])
        arg = stages if self.plan.pp_schedule in MULTI_STAGE_SCHEDULES else stages[0]
        return cls(arg, n_microbatches=self.plan.microbatches, loss_fn=self.loss_fn)

    def step(self, x_BS, y_BS):
        """Forward + backward of every microbatch; gradients are left unreduced (the caller,
        Parallelized.pipeline_step, reduces them once)."""
        if self.schedule is None:
            self.schedule = self._build()
        self._aux.clear()
        losses = []
        first, last = 0 in self.stage_ids, self.plan.num_stages - 1 in self.stage_ids
        self.schedule.step(*((x_BS,) if first else ()), target=y_BS if last else None, losses=losses)
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


    def drain(self) -> None:
        """Nothing in flight between steps: the synchronous schedules flush every step (2bw
        does not: parallel/pipedream.py)."""

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
        self.drain()
        losses = []
        first, last = 0 in self.stage_ids, self.plan.num_stages - 1 in self.stage_ids
        if self.plan.pp_schedule in V_SCHEDULES + ASYNC_SCHEDULES:  # no torch schedule to eval
            with torch.no_grad():
                losses = self._v_forward(x_BS, y_BS)
        else:
            if self.eval_schedule is None:
                self.eval_schedule = self._build()
            with torch.no_grad():
                self.eval_schedule.eval(*((x_BS,) if first else ()), target=y_BS if last else None,
                                        losses=losses)
        task = torch.stack([l.float() for l in losses]).mean() if last and losses else torch.zeros(())
        task = task.reshape(1).to(x_BS.device)
        dist.all_reduce(task, group=self.meshes.group("pp"))
        return task[0]

    def _v_forward(self, x_BS, y_BS) -> list:
        """Forward-only losses of a V placement (zbv, dualpipev), microbatch by microbatch.

        torch 2.13's zero-bubble V schedules fail in eval() ("can't steal_bwd_input if this
        stage doesn't have backward": their local hand-over at the V's tip expects a
        backward), so evaluation walks the stages itself: stage k runs on rank k (k < pp)
        or 2pp-1-k, each activation goes to the next stage's rank by send/recv (a small
        header first: its shape and dtype), and rank 0, holding both ends, computes the loss.
        """
        plan, me, n = self.plan, self.meshes.rank("pp"), self.plan.num_stages
        group = self.meshes.group("pp")
        owner = {k: r for r in range(plan.pp) for k in _stage_ids(plan, r)}  # stage -> pp rank
        chunk_of = dict(zip(self.stage_ids, self.chunks))
        device = local(next(self.model.parameters())).device
        xs, ys = x_BS.chunk(plan.microbatches), y_BS.chunk(plan.microbatches)
        losses = []
        for x, y in zip(xs, ys):
            h = x
            for k in range(n):
                if owner[k] != me:
                    continue
                if k > 0 and owner[k - 1] != me:
                    h = _recv_activation(dist.get_global_rank(group, owner[k - 1]), device, group)
                h = chunk_of[k](h)
                if k < n - 1 and owner[k + 1] != me:
                    _send_activation(h, dist.get_global_rank(group, owner[k + 1]), group)
            if n - 1 in self.stage_ids:
                losses.append(self.loss_fn(h, y))
        return losses


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def activation_messages(h) -> tuple:
    """(header, tensor) to send for activation h: a small header (its shape and dtype) first,
    which _recv_activation reads."""
    h = local(h).contiguous()
    header = torch.tensor([h.dim(), *h.shape, *[0] * (4 - h.dim()), _DTYPES.index(h.dtype)],
                          dtype=torch.long, device=h.device)
    return header, h


def _send_activation(h, dst: int, group) -> None:
    for t in activation_messages(h):
        dist.send(t, dst, group=group)


def _recv_activation(src: int, device, group):
    header = torch.empty(6, dtype=torch.long, device=device)
    dist.recv(header, src, group=group)
    ndim, *dims = header[:5].tolist()
    h = torch.empty(dims[:ndim], dtype=_DTYPES[int(header[5])], device=device)
    dist.recv(h, src, group=group)
    return h


class TiedEmbedding:
    """The token-embedding weight that the output head shares (model.tie_embeddings).

    `group` holds the first and the last pipeline rank with the same (dp, tp) coordinates
    (None without pipeline parallelism: one module pair on one rank, nothing to sync).
    """
    CANONICAL, ALIAS = "tok_emb.weight", "lm_head.weight"

    def __init__(self, model, group=None):
        self.model, self.group = model, group
        self.first, self.last = model.tok_emb is not None, model.lm_head is not None

    @property
    def param(self):  # looked up each time: FSDP2 replaces parameter objects
        return self.model.tok_emb.weight if self.first else self.model.lm_head.weight

    def broadcast_from_first(self) -> None:
        """Collective over the group: the last stage's copy := the first stage's (after init)."""
        if self.group is not None:
            src = dist.get_global_rank(self.group, 0)
            with torch.no_grad():
                dist.broadcast(local(self.param).data, src=src, group=self.group)

    def sum_grads(self, grad) -> None:
        """Collective over the group: both holders get the sum of their gradients (in
        whatever form this rank holds it: full, ZeRO-2 slice or FSDP2 shard, the same on both)."""
        if self.group is not None:
            dist.all_reduce(local(grad), group=self.group)

    def counted_elsewhere(self) -> frozenset:
        """The last stage's copy is not counted in the gradient norm (the first stage's is)."""
        return frozenset({id(self.param)}) if self.last and not self.first else frozenset()

    def checkpoint_transforms(self):
        """Save the weight once, as tok_emb.weight, whichever stage holds it; load it back
        into every holder."""
        canon, alias = self.CANONICAL, self.ALIAS
        rename = self.last and not self.first   # the last stage holds it as lm_head.weight

        def names(sd, old, new):
            return {new if k == old else k: v for k, v in sd.items()}

        def optim(optim_sd, old, new):
            groups = [{**g, "params": [new if n == old else n for n in g["params"]]}
                      for g in optim_sd.get("param_groups", [])]
            return {**optim_sd, "state": names(optim_sd["state"], old, new), "param_groups": groups}

        def transform(model_sd, optim_sd):
            if rename:
                return names(model_sd, alias, canon), optim(optim_sd, alias, canon)
            return {k: v for k, v in model_sd.items() if k != alias}, optim_sd

        def untransform(model_sd, optim_sd):
            if rename:
                return names(model_sd, canon, alias), optim(optim_sd, canon, alias)
            if self.last:  # one rank holds both modules: the head reads the same tensor
                model_sd = {**model_sd, alias: model_sd[canon]}
            return model_sd, optim_sd

        return transform, untransform


def is_tied(model) -> bool:
    """True when the model's output head uses its token-embedding matrix."""
    emb, head = getattr(model, "tok_emb", None), getattr(model, "lm_head", None)
    return emb is not None and head is not None and head.weight is emb.weight
