"""Ulysses attention (DeepSpeed-Ulysses): an all-to-all turns the sequence split into a head
split, each rank runs ordinary attention over the whole sequence for H/n heads, and a second
all-to-all turns it back.

Shapes: B batch, H heads, Q = S/n local tokens, S whole sequence, Dh head dim, n = cp ranks.
The gathered sequence arrives in the ranks' balanced chunk order (split.py); it is put in
natural order before attention (so the causal mask is the plain one) and back after.
Needs H (and the key/value heads) divisible by n.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe.all_to_all import all_to_all

from .split import positions


def _seq_to_heads(x_BHQD, group):
    """[B, H, Q, Dh] (my tokens, all heads) -> [B, H/n, S, Dh] (all tokens, my heads), with
    the sequence in gathered (rank, local) order."""
    n = dist.get_world_size(group)
    B, H, Q, Dh = x_BHQD.shape
    rows = x_BHQD.reshape(B, n, H // n, Q, Dh).permute(1, 0, 2, 3, 4).reshape(n * B, -1)
    got = all_to_all(rows, [B] * n, [B] * n, group)          # row block p from rank p
    return got.reshape(n, B, H // n, Q, Dh).permute(1, 2, 0, 3, 4).reshape(B, H // n, n * Q, Dh)


def _heads_to_seq(y_BhSD, group):
    """The inverse of _seq_to_heads."""
    n = dist.get_world_size(group)
    B, h, S, Dh = y_BhSD.shape
    Q = S // n
    rows = y_BhSD.reshape(B, h, n, Q, Dh).permute(2, 0, 1, 3, 4).reshape(n * B, -1)
    got = all_to_all(rows, [B] * n, [B] * n, group)
    return got.reshape(n, B, h, Q, Dh).permute(1, 0, 2, 3, 4).reshape(B, n * h, Q, Dh)


def _gathered_order(seq_len: int, n: int, device) -> torch.Tensor:
    """Global position of each gathered token: rank 0's tokens, then rank 1's, ..."""
    return torch.cat([positions(seq_len, n, p, device) for p in range(n)])


def ulysses_attention(q_BHQD, k_BHQD, v_BHQD, group, causal: bool = True, dropout_p: float = 0.0):
    """Attention of this rank's tokens over the whole sequence -> [B, H, Q, Dh]."""
    n = dist.get_world_size(group)
    H = q_BHQD.shape[1]
    if H % n or k_BHQD.shape[1] % n:
        raise ValueError(f"context parallelism (ulysses): {H} attention heads are not divisible by "
                         f"parallel.cp={n}; use parallel.cp_mode=ring or a cp dividing the heads")
    q, k, v = (_seq_to_heads(t, group) for t in (q_BHQD, k_BHQD, v_BHQD))
    order = _gathered_order(q.shape[2], n, q.device)        # gathered index -> position
    natural = torch.argsort(order)                          # position -> gathered index
    q, k, v = (t.index_select(2, natural) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
    return _heads_to_seq(o.index_select(2, order), group)
