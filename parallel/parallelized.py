"""Parallelized: what parallelize() did to a model, and every call a training loop needs.

The loop holds this object explicitly (nothing is stashed on the model):

    par = parallelize(model, plan, meshes, loss_fn=..., init_fn=...)
    optimizer = par.prepare_optimizer(AdamW(par.model.parameters()))   # ZeRO-1/2 slice it
    par.set_grad_sync(last_microbatch)             # accumulation: reduce in the last backward
    loss.backward()                                # or: loss = par.pipeline_step(x, y)
    norm = par.clip_grad_norm_(1.0); optimizer.step()

Gradient path (one for every layout): dense grads over dp, routers/shared experts over the
dp*tp token pool, experts over their expert-data-parallel copies (grad_sync.py / zero.py /
FSDP2), then a weight tied across pipeline stages summed over its two holders.
"""
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.stats import RoutingStats

from .dtensors import local, step_with_plain_replicated
from .data_parallel.grad_sync import GradSync
from .grads import clip_, grad_norm, held_grad, weighted_grads
from .plan import ParallelPlan
from .reduce import all_reduce_flat, sum_routing_stats


@dataclass
class Parallelized:
    model: torch.nn.Module
    plan: ParallelPlan
    meshes: object = None        # mesh.Meshes, or None for one process
    kinds: dict = None           # id(param) -> dense | pool | expert
    grad_sync: GradSync = None   # zero 0/1/2 gradient reduction (None: one process or zero 3)
    zero: object = None          # zero.ZeroState (zero 1/2) or offload.HostMasters (zero 3 +
                                 # offload=optimizer): what the optimizer steps instead
    pipeline: object = None      # pipeline.PipelineRunner when pp > 1
    tied: object = None          # pipeline.TiedEmbedding when a weight spans two stages
    ledger: object = None        # ledger.CommLedger (bytes per collective kind), with meshes
    baton: object = None         # interleave.Baton under parallel.a2a_overlap=1f1b

    # ------------------------------------------------------------ data layout
    @property
    def dp_rank(self) -> int:
        """This rank's row stream (context-parallel ranks of one stream share it)."""
        return self.meshes.rank("dp") // self.plan.cp if self.meshes is not None else 0

    @property
    def dp_size(self) -> int:
        return self.plan.dp

    def _group(self, name: str):
        return self.meshes.group(name) if self.meshes is not None else None

    def checkpoint_transforms(self):
        """(transform, untransform) of (model_sd, optim_sd) into the layout-free form a
        checkpoint holds (their one home: parallel/state_dict.py)."""
        from .state_dict import transforms
        return transforms(self)

    def split_sequence(self, x_BS):
        """This rank's part of [B, S, ...] whole sequences: the balanced chunks of its cp
        rank (parallel/context/split.py), or x itself without context parallelism."""
        if self.plan.cp == 1:
            return x_BS
        from .context.apply import split_sequence
        return split_sequence(x_BS, self._group("cp"))

    # ------------------------------------------------------------ gradients
    def prepare_optimizer(self, optimizer):
        """The optimizer to train with: for zero 1/2 a same-class optimizer over this rank's
        slices (it all-gathers the updated slices after each step), for zero 3 with
        offload=optimizer one over host copies of the shards; with offload=params the same
        optimizer with its fused CPU step; else `optimizer`. A MuonAdamW gets the layout's
        orthogonaliser (parallel/muon.py: pieces of a matrix orthogonalised whole by an owner)."""
        if self.zero is not None:
            from .data_parallel.zero import shard_optimizer
            optimizer = shard_optimizer(optimizer, self.zero)
        elif self.plan.offload == "params" and self.meshes is not None:
            from .data_parallel.offload import same_optimizer
            optimizer = same_optimizer(type(optimizer), optimizer.param_groups, optimizer.defaults, fused=True)
        optimizer = step_with_plain_replicated(optimizer)  # tp: DTensors beside plain tensors
        from optim.muon import MuonAdamW
        if isinstance(optimizer, MuonAdamW) and self.meshes is not None:
            from .muon import for_layout, layout_groups  # whole-matrix updates for the pieces
            etp = self.meshes.group("etp") if self.plan.etp > 1 else None  # this layout holds
            optimizer.orthogonaliser = for_layout(optimizer, self.model, self.zero, self.kinds,
                                                  self.comm_label, etp, layout_groups(self.meshes),
                                                  torch.device(self.meshes.dense.device_type))
        return optimizer

    def set_grad_sync(self, enabled: bool) -> None:
        """False during gradient-accumulation microsteps (no communication), True for the last."""
        if self.grad_sync is not None:
            self.grad_sync.enabled = enabled
        if self.plan.zero == 3 and self.meshes is not None:
            self.model.set_requires_gradient_sync(enabled)

    def pipeline_step(self, x_BS, y_BS) -> torch.Tensor:
        """pp > 1: forward+backward of all microbatches by the schedule, then one gradient
        reduction; returns the loss (task + aux, what one process reports) on every rank."""
        if self.grad_sync is not None:
            self.grad_sync.enabled = False  # one reduction after all microbatches
        try:
            loss = self.pipeline.step(x_BS, y_BS)
        finally:
            if self.grad_sync is not None:
                self.grad_sync.enabled = True
        self.finish_backward(deferred=self.pipeline.has_grads)  # (2bw's first step has none)
        return loss

    def finish_backward(self, deferred: bool = False) -> None:
        """The gradient work after a step's last backward, in one place. Without a pipeline
        the data-parallel reduction already ran at the end of that backward (GradSync's
        autograd callback, or FSDP2's hooks); a pipeline defers it (`deferred`) to once after
        all micro-batches. Then a weight tied across stages is summed over its two holders."""
        if deferred and self.grad_sync is not None:
            self.grad_sync.sync()
        if self.baton is not None and self.plan.zero == 3:  # units held gathered for the step
            from .data_parallel.fsdp import reshard_all
            reshard_all(self.model)
        if self.tied is not None:
            self.tied.sum_grads(held_grad(self.tied.param, self.zero))

    def update_router_bias(self, rate: float, applied=None) -> None:
        """After the optimizer step: move every router's aux-loss-free selection bias by its
        pending expert load, summed over the token pool (moe.bias_update_rate; 0 = off).
        applied: None, or a 0-dim device tensor, 0 where the step was skipped on the device
        (Router.update_selection_bias)."""
        if rate <= 0:
            return
        from moe.aux import moe_layers
        for _, layer in moe_layers(self.model):
            layer.router.update_selection_bias(rate, self.sum_load(layer.router.pending_load),
                                               applied)

    def pipeline_aux_loss(self) -> torch.Tensor:
        """pp > 1, after pipeline_step: the aux part of its loss, summed over the stages (each
        holds its own MoE layers' share), the same on every pp rank."""
        aux = self.pipeline.stage_aux_loss().float().reshape(1).clone()
        dist.all_reduce(aux, group=self._group("pp"))
        return aux[0]

    def grads(self) -> list:
        """The local gradient tensors this rank holds (slices, shards, pieces), e.g. to unscale."""
        return [g for g, _ in self._weighted_grads()]

    def _weighted_grads(self) -> list:
        elsewhere = self.tied.counted_elsewhere() if self.tied is not None else frozenset()
        return weighted_grads(self.model, self.plan, self.kinds, self.zero, elsewhere)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm (before clipping), each element counted once, the same on
        every rank; scales all gradients to at most max_norm when max_norm > 0."""
        items = self._weighted_grads()
        p0 = next(self.model.parameters())
        with self.comm_label("other"):
            norm = grad_norm(items, local(p0).device, self.meshes is not None)
        if max_norm > 0:
            clip_(items, norm, max_norm)
        return norm

    def recording_comm(self):
        """Context manager: count this rank's collective bytes by kind (see ledger.py); a
        no-op for one process. Read them with `par.ledger.take()`."""
        return self.ledger.recording() if self.ledger is not None else contextlib.nullcontext()

    def comm_label(self, kind: str):
        """Context manager: book the collectives inside under ledger kind `kind`."""
        return self.ledger.labelled(kind) if self.ledger is not None else contextlib.nullcontext()

    # ------------------------------------------------------------ reductions
    def mean_over_dp(self, values: torch.Tensor) -> torch.Tensor:
        """Average per-rank values over the data-parallel ranks (tp/pp peers hold equal ones)."""
        out = values.detach().clone()
        if self.meshes is not None:
            all_reduce_flat([out], self._group("dp"), self.plan.replicas)
        return out

    def sum_load(self, load_E: torch.Tensor) -> torch.Tensor:
        """Expert loads summed over the ranks that route distinct tokens (the pool)."""
        out = load_E.clone()
        if self.meshes is not None:
            with self.comm_label("other"):
                all_reduce_flat([out], self._group("pool"))
        return out

    def sum_routing_stats(self, stats: dict) -> dict:
        """Collective: {layer name: RoutingStats} summed over the token pool, and under
        pipeline parallelism every stage's layers gathered, so rank 0 sees the whole model.
        Every rank must pass the same layer names in the same order as its stage peers."""
        if self.meshes is None:
            return stats
        pool = self._group("pool")
        out = {name: sum_routing_stats(s, pool) for name, s in stats.items()}
        if self.plan.pp > 1:
            parts = [None] * self.plan.pp
            cpu = (lambda t: None if t is None else t.cpu())
            mine = {k: (v.routed_E.cpu(), v.kept_E.cpu(), v.num_tokens, v.top_k, v.entropy.cpu(),
                        cpu(v.rank_rows), cpu(v.rank_rows_unreplicated)) for k, v in out.items()}
            dist.all_gather_object(parts, mine, group=self._group("pp"))
            out = {k: RoutingStats(*v) for part in parts for k, v in part.items()}
        return out
