"""Context parallelism applied from outside: a GPT (or its pipeline stage) runs on this
rank's part of every sequence.

Shapes: B batch, S whole sequence, Q = S/cp local tokens, D model dim, H heads, Dh head dim.
Changed in place (instance attributes: parameter names stay):
  every block's attention  q/k/v/o projections as before (tensor-parallel styles still apply),
                           rotary angles at each token's global position, then ring or
                           Ulysses attention over the cp group instead of local attention;
  the embedding            learned positions at each token's global position;
  multi-token prediction   each depth's ids and targets shifted along the whole sequence (the
                           labels all-gathered over the cp group: the shift crosses the parts),
                           each rank's loss divided by the whole sequence's labelled count / cp.
Everything else already works on tokens wherever they are: norms, dense FFNs, MoE layers
(routing is per token; the sequence balance loss sums its statistics over the cp group,
parallel/apply.py _set_sequence_groups), the loss (each rank's mean over its tokens; the cp ranks'
means average to the whole sequence's, all parts being equal).
Inputs and targets are cut by `split_sequence` (split.py's balanced order) before the model.
"""
import torch
import torch.distributed as dist

from models.blocks import blocks
from models.layers import rope_cos_sin
from models.mtp import shifted_labels

from .ring import ring_attention
from .split import positions, split
from .ulysses import ulysses_attention


def apply_context_parallel(model, group, mode: str, chunks=()) -> None:
    """Run `model`'s attention (and positions) over the sequence split across `group`.
    `chunks`: pipeline stage shells sharing the model's modules (their embed is wrapped too)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    for block in blocks(model):
        block.attn.forward = _attention(block.attn, group, mode, n, rank)
    for m in (model, *chunks):
        if getattr(m, "pos_emb", None) is not None and getattr(m, "tok_emb", None) is not None:
            m.embed = _embed(m, n, rank)
    if getattr(model, "mtp", None) is not None:
        model.mtp_labels = _mtp_labels(group, n, rank)


def _attention(attn, group, mode: str, n: int, rank: int):
    def forward(x_BQD, kv_BLD=None, bias_1HSL=None, causal: bool = False):
        if kv_BLD is not None or bias_1HSL is not None:
            raise ValueError("context parallelism runs self-attention without an additive bias "
                             "only (the GPT); set parallel.cp=1 for this model")
        Q = x_BQD.shape[1]
        S = Q * n
        cos = sin = None
        if attn.rope_theta is not None:
            cos, sin = rope_cos_sin(S, attn.rope_dim, attn.rope_theta, x_BQD.device)
            pos = positions(S, n, rank, x_BQD.device)
            cos, sin = cos.index_select(0, pos), sin.index_select(0, pos)
        q, k, v = attn.qkv(x_BQD, None, cos, sin)
        if mode == "ring":
            o = ring_attention(q, k, v, group, causal=causal, seq_len=S)
        else:
            p = attn.dropout if attn.training else 0.0
            o = ulysses_attention(q, k, v, group, causal=causal, dropout_p=p)
        return attn.out(o)
    return forward


def _embed(model, n: int, rank: int):
    def embed(input_ids_BQ: torch.Tensor) -> torch.Tensor:
        if input_ids_BQ.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"GPT expects integer token ids [B, S], got dtype {input_ids_BQ.dtype}")
        S = input_ids_BQ.shape[-1] * n
        if S > model.model_cfg.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds model.max_seq_len="
                             f"{model.model_cfg.max_seq_len}; raise model.max_seq_len or shorten the data")
        x_BQD = model.tok_emb(input_ids_BQ) + model.pos_emb(positions(S, n, rank, input_ids_BQ.device))
        return model.drop(x_BQD)
    return embed


def _mtp_labels(group, n: int, rank: int):
    """models/mtp.shifted_labels for this rank's part of each sequence: position i's ids and
    targets lie up to K tokens ahead, possibly on another rank, so the (small, integer) labels
    are gathered whole, shifted, and this rank's positions taken. The count each rank divides
    by is the whole sequence's / cp: the cp ranks' mean is then the whole sequence's mean (the
    last K positions, masked, all sit on one rank)."""
    def shifted(labels_BQ: torch.Tensor, depth: int) -> list:
        parts = [torch.empty_like(labels_BQ) for _ in range(n)]
        dist.all_gather(parts, labels_BQ.contiguous(), group=group)
        B, S = labels_BQ.shape[0], labels_BQ.shape[1] * n
        full_BS = labels_BQ.new_empty(B, S)
        for r, part in enumerate(parts):
            full_BS[:, positions(S, n, r, labels_BQ.device)] = part
        mine = positions(S, n, rank, labels_BQ.device)
        return [(ids_BS[:, mine], tgt_BS[:, mine], count / n)
                for ids_BS, tgt_BS, count in shifted_labels(full_BS, depth)]
    return shifted


def split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's part (balanced chunks) of a [B, S, ...] tensor of whole sequences."""
    return split(x, dist.get_world_size(group), dist.get_rank(group), dim=1)
