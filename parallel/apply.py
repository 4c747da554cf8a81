"""parallelize(): apply a ParallelPlan to a single-device model, in the fixed order
pipeline split -> tensor parallel -> expert parallel -> recomputation -> compile -> ZeRO/DP.

The model is changed in place and a ParallelState is attached as `model.moekit_parallel`, so
the few calls a training loop needs take only the model (and its optimizer):

    plan = ParallelPlan(...).validate(world, model_cfg, moe_cfg, batch_size)
    meshes = build_meshes(plan)                  # None for a single process
    model = parallelize(model, plan, meshes)
    optimizer = prepare_optimizer(model, AdamW(...))   # ZeRO-1/2 slice it; else unchanged
    loss.backward()                                    # gradients reduced at its end
    clip_grad_norm_(model, 1.0); optimizer.step()      # parallel.grads.clip_grad_norm_
"""
from dataclasses import dataclass, field

import torch.nn as nn

from moe import MoELayer

from .data import GradSync, ZeroState, apply_fsdp, param_kinds, reduction_groups, shard_optimizer
from .plan import ParallelPlan


@dataclass
class ParallelState:
    plan: ParallelPlan
    meshes: object = None             # mesh.Meshes, or None for one process
    kinds: dict = field(default_factory=dict)   # id(param) -> dense | pool | expert
    grad_sync: GradSync = None        # zero 0/1/2 gradient reduction
    zero_state: ZeroState = None      # zero 1/2 slices
    pipeline: object = None           # pipeline.PipelineRunner when pp > 1


def _blocks(model) -> list:
    blocks = getattr(model, "blocks", None)
    return list(blocks) if blocks is not None else []


def parallelize(model: nn.Module, plan: ParallelPlan, meshes=None, *, loss_fn=None,
                init_fn=None) -> nn.Module:
    """Apply `plan` (already validated) to `model`; `meshes` from build_meshes (None: 1 process).

    init_fn(model), if given, materialises and initialises a meta-device model at the point
    where it is cheapest and still safe: after the pipeline split and the tensor/expert
    sharding (so no rank ever holds the whole model), before data-parallel gradient hooks are
    registered on the parameter objects (zero 0/1/2), or after FSDP2 sharding (zero 3).

    loss_fn(logits, targets) is needed only for pipeline parallelism (the last stage computes
    the loss). Returns the model (the same object unless pipelining wraps it).
    """
    if plan.dp < 1:
        raise ValueError("parallelize needs a validated plan (dp resolved): call plan.validate(world) first")
    if meshes is None and plan.world > 1:
        raise ValueError(f"plan uses {plan.world} ranks but meshes=None; pass build_meshes(plan)")
    state = ParallelState(plan, meshes)
    if plan.pp > 1:
        from .pipeline import split_pipeline
        state.pipeline = split_pipeline(model, plan, meshes, loss_fn)
    if plan.tp > 1:
        from .tensor import apply_tensor_parallel
        apply_tensor_parallel(model, meshes)
    if plan.ep > 1:
        ep_group = meshes.group("ep")
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.set_ep_group(ep_group)
    if plan.precision != "fp32":
        from .precision import apply_precision
        apply_precision(model, plan.precision)
    if plan.recompute != "none":
        from .recompute import apply_recompute
        apply_recompute(_blocks(model))
    if plan.compile:
        for b in _blocks(model):
            b.compile()
    if init_fn is not None and plan.zero != 3:
        init_fn(model)
    if meshes is not None:
        _apply_data_parallel(model, state)
    if init_fn is not None and plan.zero == 3:
        init_fn(model)
    state.kinds = param_kinds(model)  # after FSDP2, which replaces the parameter objects
    model.moekit_parallel = state
    return model


def _apply_data_parallel(model, state) -> None:
    plan = state.plan
    if plan.zero == 3:
        roots = state.pipeline.chunks if state.pipeline is not None else None
        apply_fsdp(model, state.meshes, _blocks(model), roots)
        return
    buckets = reduction_groups(model, state.meshes)
    if plan.zero in (1, 2):
        state.zero_state = ZeroState(buckets, plan.zero)
    hook = state.zero_state.after_backward if plan.zero == 2 else None
    state.grad_sync = GradSync(buckets, hook)


def prepare_optimizer(model, optimizer):
    """The optimizer to train with: for zero 1/2 a same-class optimizer over this rank's slices."""
    state = getattr(model, "moekit_parallel", None)
    if state is None or state.zero_state is None:
        return optimizer
    return shard_optimizer(optimizer, state.zero_state)


def set_requires_gradient_sync(model, flag: bool) -> None:
    """False during gradient-accumulation microsteps (no communication), True for the last."""
    state = getattr(model, "moekit_parallel", None)
    if state is None:
        return
    if state.grad_sync is not None:
        state.grad_sync.enabled = flag
    if state.plan.zero == 3:
        model.set_requires_gradient_sync(flag)
