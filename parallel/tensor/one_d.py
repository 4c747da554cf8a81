"""Megatron-style 1-D tensor parallelism for the GPT of models/, with sequence parallelism.

Shapes: B batch, S sequence, D model dim, F ffn dim, V vocab, s = S/tp, b = B/tp.
Between blocks the residual stream is sequence-sharded: each tp rank holds x [B, s, D].
  embeddings  tok_emb vocab-parallel (rows split, all-reduced); positions added on the full
              sequence, then split along S before the embedding dropout (dropout sees only
              this rank's part, as in sequence parallelism)
  norms       SequenceParallel: run on [B, s, D], weights replicated
  attention   q/k/v column-parallel (heads split), o row-parallel, reduce-scattered to [B, s, D]
  MLA         the input gathered to [B, S, D] (its gradient arrives whole: every rank's
              kept block); the down-projections wq_a / wkv_a and the latents' norms
              replicated; the up-projections wq_b (or wq) and wkv_b column-parallel (heads
              split; their input gradient all-reduced, so everything before them gets whole
              gradients), the shared rotary key's gradient summed over tp (each rank's heads
              read it), o row-parallel as above (Megatron's MLA split)
  dense FFN   w1 (and w3) split along F, w2 along F: all-gather S, matmuls, reduce-scatter S
  MoE FFN     dropless token choice (moe.config.routes_per_sequence false): runs on the
              sequence-split tokens as they are ([B, s, D], Megatron's MoE under sequence
              parallelism: no exchange, any micro-batch size); the sequence balance loss
              sums each sequence's statistics over tp (set by parallel/apply.py).
              A capacity or expert choice decides per sequence: whole sequences are split
              across tp ranks instead ([B, s, D] -> [b, S, D] by all-to-all, so the batch
              must divide by tp). Either way every token is routed and computed once;
              router and experts stay plain tensors, reduced over the "pool" (see data.py);
              the layer's aux_loss becomes the tp-mean so the total matches one process.
  MTP depths  (models/mtp.py) their norms and eh_proj per token on [B, s, D], weights
              replicated (SequenceParallel: their gradients summed over tp); the embedding of
              the tokens ahead split along S as the main one; their blocks as above
  output      lm_head column-parallel over V (tied to tok_emb when the model ties them), the
              logits all-gathered so any loss function works.
"""
import functools

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from models.blocks import blocks
from models.layers import LatentAttention, rms_norm
from moe import DenseFFN, MoELayer
from moe.cast_once import announce

from . import comm as tp_comm
from ..dtensors import local


def _tp_mean(x, group):
    """Value: mean over the group; gradient: 1/P to the local term (the loss is replicated)."""
    P = dist.get_world_size(group)
    total = x.detach().clone()
    dist.all_reduce(total, group=group)
    return x / P + (total - x.detach()) / P


def moe_layout_hooks(layer: MoELayer, swap_group, tp_group, split_dim: int, cat_dim: int) -> None:
    """Give the MoE layer whole sequences: its input's dim `split_dim` (the batch) is split over
    swap_group and dim `cat_dim` (1d: the sequence; 2d: the hidden dim) gathered, by one
    all-to-all; the output goes back the same way; the aux loss becomes the tp-mean."""
    def pre(_mod, args):
        return (tp_comm.swap(local(args[0]), swap_group, split_dim, cat_dim),) + tuple(args[1:])

    def post(mod, _args, out):
        mod.aux_loss = _tp_mean(mod.aux_loss, tp_group)
        return tp_comm.swap(out, swap_group, cat_dim, split_dim)

    # prepend: hooks added earlier (pipeline aux injection/recording) must see the tp-mean
    # aux loss and the sequence-sharded output
    layer.register_forward_pre_hook(pre, prepend=True)
    layer.register_forward_hook(post, prepend=True)


def moe_sequence_hooks(layer: MoELayer, tp_group) -> None:
    """The MoE layer on this rank's part of every sequence: a plain tensor in, the aux loss
    the tp-mean (prepended for the same reason as moe_layout_hooks')."""
    def pre(_mod, args):
        return (local(args[0]),) + tuple(args[1:])

    def post(mod, _args, out):
        mod.aux_loss = _tp_mean(mod.aux_loss, tp_group)

    layer.register_forward_pre_hook(pre, prepend=True)
    layer.register_forward_hook(post, prepend=True)


def _shard_dense_ffn(ffn: DenseFFN, mesh) -> None:
    """w1/w3 [1, D, F] split on F, w2 [1, F, D] on F; biases b1/b3 split, b2 replicated."""
    bank = ffn.bank
    if bank.b2 is not None:
        raise NotImplementedError("tensor parallelism of a dense FFN with biases (model.bias=true) "
                                  "is not implemented; set model.bias=false or parallel.tp=1")
    dims = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1}
    for name, dim in dims.items():
        p = getattr(bank, name)
        if p is not None:
            setattr(bank, name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(dim)])))

    def post(_mod, _args, out):
        return out.redistribute(mesh, [Shard(1)]).to_local()

    ffn.register_forward_pre_hook(functools.partial(_gather_input, mesh=mesh))
    ffn.register_forward_hook(post)


def _gathered(x, mesh):
    """The sequence-sharded [B, s, D] x (a DTensor or this rank's local shard) gathered to a
    replicated [B, S, D] DTensor."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(1)])
    return x.redistribute(mesh, [Replicate()])


def _gather_input(_mod, args, mesh):
    """A forward pre-hook: the module's first input gathered (_gathered); announced as made
    from the shard (moe/cast_once.py), so parallel.recompute_modules=layernorm gathers it
    again in backward instead of keeping it."""
    whole = _gathered(args[0], mesh)
    announce(args[0], whole, functools.partial(_gathered, mesh=mesh))
    return (whole,) + tuple(args[1:])


def _heads_norm(norm: nn.RMSNorm, group) -> None:
    """qk_norm's weight is replicated while each rank normalises its own heads: the weight's
    gradient is the sum of the ranks' (tp_comm.sum_grad), the same on every rank."""
    def forward(x):
        return rms_norm(x, norm.normalized_shape, tp_comm.sum_grad(norm.weight, group), norm.eps)
    norm.forward = forward


def _check_input(model, group) -> None:
    """Fail on shapes the tp split cannot take before the embedding's first collective (a bad
    shape would otherwise abort inside the backend with a size mismatch)."""
    P = dist.get_world_size(group)
    whole = any(isinstance(m, MoELayer) and m.router.config.routes_per_sequence
                for m in model.modules())

    def pre(_mod, args):
        B, S = args[0].shape[0], args[0].shape[-1]
        if S % P:
            raise ValueError(f"tensor parallelism: sequence length {S} is not divisible by tp={P} "
                             f"(sequence parallelism splits each sequence into {P} equal parts); "
                             f"use sequences of a multiple of {P} tokens (train.py: data.seq_len)")
        if whole and B % P:
            raise ValueError(f"tensor parallelism: batch of {B} sequences is not divisible by tp={P} "
                             f"(MoE layers with a capacity or expert choice route whole sequences, "
                             f"split across the tp ranks); use a batch of a multiple of {P} "
                             f"sequences")
    model.tok_emb.register_forward_pre_hook(pre, prepend=True)


def _split_after_embedding(model, group) -> None:
    def pre(_mod, args):
        return (tp_comm.split(local(args[0]), group, 1),) + tuple(args[1:])
    model.drop.register_forward_pre_hook(pre)


def apply_tensor_parallel(model: nn.Module, meshes) -> None:
    """Shard the GPT (or the pipeline stage of it) over meshes' tp dim, in place."""
    mesh, group = meshes.dense["tp"], meshes.group("tp")
    tied = model.lm_head is not None and model.tok_emb is not None and \
        model.lm_head.weight is model.tok_emb.weight
    if model.tok_emb is not None:
        parallelize_module(model.tok_emb, mesh, RowwiseParallel(input_layouts=Replicate(),
                                                                output_layouts=Replicate()))
        _check_input(model, group)
        _split_after_embedding(model, group)
    for block in blocks(model):  # the MTP depths' blocks too
        _shard_block(block, mesh, group)
    for depth in getattr(model, "mtp", None) or []:  # per token on the sequence shards
        parallelize_module(depth, mesh, {"enorm": SequenceParallel(use_local_output=True),
                                         "hnorm": SequenceParallel(use_local_output=True),
                                         "eh_proj": SequenceParallel(use_local_output=True),
                                         "norm": SequenceParallel()})
    if model.norm is not None:
        parallelize_module(model.norm, mesh, SequenceParallel())
    if model.lm_head is not None:
        parallelize_module(model.lm_head, mesh, ColwiseParallel(input_layouts=Shard(1),
                                                                output_layouts=Replicate()))
    if tied:  # both split the vocab dim (Shard(0)): one parameter again
        model.lm_head.weight = model.tok_emb.weight


def _shard_block(block, mesh, group) -> None:
    attn = block.attn
    if isinstance(attn, LatentAttention):  # the input gathered by a hook (below)
        heads = {"attn.wq_b" if attn.q_lora else "attn.wq": ColwiseParallel(),
                 "attn.wkv_b": ColwiseParallel()}
    else:
        attn.register_forward_pre_hook(functools.partial(_gather_input, mesh=mesh))
        heads = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel()}
    parallelize_module(block, mesh, {"attn_norm": SequenceParallel(), **heads,
                                     "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
                                     "ffn_norm": SequenceParallel()})
    if isinstance(attn, LatentAttention):
        _latent_attention_hooks(attn, group)
    if block.attn.q_norm is not None:
        for norm in (block.attn.q_norm, block.attn.k_norm):
            _heads_norm(norm, group)
    if isinstance(block.ffn, MoELayer) and block.ffn.router.config.routes_per_sequence:
        moe_layout_hooks(block.ffn, group, group, split_dim=0, cat_dim=1)
    elif isinstance(block.ffn, MoELayer):
        moe_sequence_hooks(block.ffn, group)
    elif isinstance(block.ffn, DenseFFN):
        _shard_dense_ffn(block.ffn, mesh)
    else:
        raise TypeError(f"tensor parallelism does not know FFN type {type(block.ffn).__name__}")


def _latent_attention_hooks(attn, group) -> None:
    """MLA's input gathered, its shared rotary key's gradient summed (module docstring)."""
    def gather_input(_mod, args):
        whole = _latent_input(args[0], group)
        announce(args[0], whole, functools.partial(_latent_input, group=group))
        return (whole,) + tuple(args[1:])
    attn.register_forward_pre_hook(gather_input)
    project, rope = attn.wkv_a.forward, attn.rope_dim   # the module's own GEMM (FP8 under fp8)

    def latent_and_rotary_key(x):
        return tp_comm.sum_grad_tail(project(x), group, rope)
    attn.wkv_a.forward = latent_and_rotary_key


def _latent_input(x, group):
    return tp_comm.gather_replicated(x.to_local() if isinstance(x, DTensor) else x, group, 1)


__all__ = ["apply_tensor_parallel", "Partial"]
