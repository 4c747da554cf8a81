"""parallelize(): apply a ParallelPlan to a single-device model, in the fixed order
pipeline split -> tensor parallel -> expert parallel -> context parallel -> precision ->
recomputation -> compile
-> ZeRO/DP, and return the Parallelized handle the training loop uses (parallelized.py):

    plan = ParallelPlan(...).validate(world, model_cfg, moe_cfg, batch_size, seq_len)
    meshes = build_meshes(plan)                  # None for a single process
    par = parallelize(model, plan, meshes)
    optimizer = par.prepare_optimizer(AdamW(par.model.parameters()))

Three objects describe a layout: ParallelPlan (the degrees, pure arithmetic), Meshes (the
process groups) and Parallelized (what was applied to this model).
"""
import os

import torch.nn as nn

from models.blocks import blocks

from .data_parallel.grad_sync import GradSync, reduction_buckets
from .kinds import param_kinds
from .parallelized import Parallelized
from .plan import ParallelPlan


def parallelize(model: nn.Module, plan: ParallelPlan, meshes=None, *, loss_fn=None,
                init_fn=None, fp8_rows=None) -> Parallelized:
    """Apply `plan` (already validated) to `model` in place; `meshes` from build_meshes
    (None: one process). Returns the Parallelized handle (its .model is `model`).

    init_fn(model), if given, materialises and initialises a meta-device model at the point
    where it is cheapest and still safe: after the pipeline split and the tensor/expert
    sharding (so no rank ever holds the whole model), before data-parallel gradient hooks are
    registered on the parameter objects (zero 0/1/2), or after FSDP2 sharding (zero 3).

    loss_fn(logits, targets) is needed only for pipeline parallelism (the last stage computes
    the loss). fp8_rows: the tokens of a micro-batch, for precision=fp8 to keep the Linears
    that cannot gain at that size in bf16 (parallel/fp8.py apply_fp8; None: every Linear FP8).
    """
    if plan.dp < 1:
        raise ValueError("parallelize needs a validated plan (dp resolved): call plan.validate(world) first")
    if meshes is None and plan.world > 1:
        raise ValueError(f"plan uses {plan.world} ranks but meshes=None; pass build_meshes(plan)")
    if meshes is None and plan.param_dtype != "fp32":
        raise ValueError(f"parallel.param_dtype={plan.param_dtype} keeps its fp32 masters in ZeRO "
                         f"slices, which need a process group: pass build_meshes(plan), in one "
                         f"process too (a group of one)")
    par = Parallelized(model, plan, meshes)
    tied = _tied_embedding(model, meshes)  # decided before the split prunes either end
    if plan.a2a_overlap == "1f1b":  # every MoE layer waits for its exchanges through it (below)
        from .interleave import Baton
        par.baton = Baton()
    if plan.pp > 1:
        from .pipeline.split import split_pipeline
        par.pipeline = split_pipeline(model, plan, meshes, loss_fn, par.baton)
    if plan.precision == "fp8":
        from .fp8 import apply_fp8
        apply_fp8(model, plan.fp8_recipe, meshes, fp8_rows, bool(plan.compile))  # before tp splits
    if plan.tp > 1 and plan.tp_mode == "1d":
        from .tensor.one_d import apply_tensor_parallel
        apply_tensor_parallel(model, meshes)
    elif plan.tp > 1:
        from .tensor.grid import apply_grid_tensor_parallel
        apply_grid_tensor_parallel(model, meshes)
    if plan.precision == "fp8" and plan.tp > 1:
        from .fp8 import check_split_linears
        check_split_linears(model)
    if plan.ep > 1:
        from .expert import apply_expert_parallel
        apply_expert_parallel(model, meshes.group("ep"), stage_only=plan.pp > 1,
                              ranks_per_node=ranks_per_node(plan))
    if plan.etp > 1:
        from .expert import apply_expert_tensor_parallel
        apply_expert_tensor_parallel(model, meshes.group("etp"), stage_only=plan.pp > 1)
    if meshes is not None:  # micro_batch / global_batch balance losses count over the token pool
        from moe.aux import set_balance_group
        set_balance_group(model, meshes.group("pool"))
    if plan.cp > 1:
        from .context.apply import apply_context_parallel
        chunks = par.pipeline.chunks if par.pipeline is not None else ()
        apply_context_parallel(model, meshes.group("cp"), plan.cp_mode, chunks)
    if meshes is not None:
        _set_sequence_groups(model, plan, meshes)
    if plan.precision != "fp32":
        from .precision import apply_precision
        apply_precision(model, plan.precision)
    if plan.recompute != "none":
        from .recompute import apply_recompute
        apply_recompute(blocks(model), plan.recompute, plan.recompute_parts)
    if plan.compile:
        from .compile import compile_blocks
        compile_blocks(model)
    if init_fn is not None and plan.zero != 3:
        init_fn(model)
    if meshes is not None:
        _apply_data_parallel(model, par)
    if init_fn is not None and plan.zero == 3:
        init_fn(model)
    par.tied = tied(model) if tied is not None else None
    if par.tied is not None and init_fn is not None:
        par.tied.broadcast_from_first()
    if par.zero is not None:
        par.zero.refresh_from_params()  # slices taken before init / the tie broadcast
    if plan.param_dtype != "fp32" and plan.zero in (1, 2):  # the fp32 masters: the slices just
        from .precision import DTYPES                          # taken (ZeRO-3: FSDP2's shards)
        par.zero.cast_params(DTYPES[plan.param_dtype])
    par.kinds = param_kinds(model)  # after FSDP2, which replaces the parameter objects
    if par.baton is not None:  # every MoE layer waits for its exchanges through the baton
        from moe.aux import moe_layers
        for _, layer in moe_layers(model):
            layer.set_a2a_waiter(par.baton.wait)
    if meshes is not None:
        from .ledger import CommLedger, mesh_groups
        tied_group = {"tied": par.tied.group} if par.tied is not None else {}
        par.ledger = CommLedger(mesh_groups(meshes, tied_group), ranks_per_node(plan))
    return par


def ranks_per_node(plan: ParallelPlan) -> int | None:
    """Global ranks per node: parallel.gpus_per_node, else zeropp_hpz data-parallel ranks
    times the tp ranks beside each (rank order pp x dp x tp), else torchrun's
    LOCAL_WORLD_SIZE, else None (one node)."""
    if plan.gpus_per_node:
        return plan.gpus_per_node
    if plan.zeropp_hpz:
        return plan.zeropp_hpz * plan.tp
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else None


def _set_sequence_groups(model, plan, meshes) -> None:
    """Each MoE layer's ranks holding parts of its sequences: cp's, and tp's where 1-D tensor
    parallelism hands it the sequence split (dropless token choice, parallel/tensor/one_d.py);
    their sequence balance loss sums each sequence's statistics over them."""
    from moe.aux import moe_layers
    split_by_tp = plan.tp > 1 and plan.tp_mode == "1d"
    for _, layer in moe_layers(model):
        groups = ((meshes.group("cp"),) if plan.cp > 1 else ()) + \
            ((meshes.group("tp"),) if split_by_tp and not layer.router.config.routes_per_sequence
             else ())
        if groups:
            layer.set_sequence_group(groups if len(groups) > 1 else groups[0])


def _tied_embedding(model, meshes):
    """A factory for the TiedEmbedding of a tied model (called after the split), or None.
    Creating the stage-pair groups is collective, so every rank does it here, in order."""
    from .pipeline.tied import TiedEmbedding, is_tied
    if not is_tied(model):
        return None
    from .mesh import stage_pair_group
    group = stage_pair_group(meshes) if meshes is not None else None

    def make(m):
        holds = m.tok_emb is not None or m.lm_head is not None
        return TiedEmbedding(m, group) if holds else None
    return make


def _fsdp_precision(plan):
    """ZeRO-3 under param_dtype=bf16: FSDP2 gathers the parameters and reduces the gradients in
    bf16, its fp32 shards being the masters (None: FSDP2's default, all fp32)."""
    if plan.param_dtype == "fp32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from .precision import DTYPES
    low = DTYPES[plan.param_dtype]
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)


def _apply_data_parallel(model, par) -> None:
    plan, meshes = par.plan, par.meshes
    if plan.ps_servers:  # the parameter server sums gradients (data_parallel/param_server): no hooks
        return
    if plan.zero == 3:
        from .data_parallel.fsdp import apply_fsdp
        roots = par.pipeline.chunks if par.pipeline is not None else None
        apply_fsdp(model, meshes, blocks(model), roots, mp_policy=_fsdp_precision(plan),
                   comm_label=par.comm_label)
        if plan.offload == "optimizer":
            from .data_parallel.offload import HostMasters
            par.zero = HostMasters(model, blocks(model), plan.zero_prefetch)
        return
    buckets = reduction_buckets(model, meshes, param_kinds(model))
    if plan.zero in (1, 2):
        from .data_parallel.zero import ZeroState
        from .data_parallel.zeropp import labelled_reduce_scatter
        rs = labelled_reduce_scatter(par.comm_label) if plan.zeropp_quantize_grads else None
        par.zero = ZeroState(buckets, plan.zero, host=plan.offload == "optimizer",
                             reduce_scatter_fn=rs)
    hook = par.zero.after_backward if plan.zero == 2 else None
    par.grad_sync = GradSync(buckets, hook)
