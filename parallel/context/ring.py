"""Ring attention: exact attention over a sequence split across the cp ranks.

Shapes: B batch, H heads, Q local query tokens, K local key tokens (Q = K = S/n), Dh head dim,
n = cp ranks. Each rank keeps its queries; the key/value blocks travel around the ring, rank r
sending to r+1 and receiving from r-1, the next block's send/recv issued before the current
block is computed. Block results are merged exactly with the log-sum-exp rule:
    lse = logaddexp(lse_a, lse_b),  out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)
Each block is computed chunk pair by chunk pair (each rank holds 2 chunks of S/2n tokens,
split.py): a pair whose key chunk lies after its query chunk is skipped under the causal
mask, a diagonal pair is masked inside, so every rank computes the same 2n+1 pairs; each pair
runs in tiles of ROWS query rows, so the transient scores are [B, H, ROWS, S/2n]: activation
memory per rank stays linear in S/n. Backward recomputes each pair's
probabilities from the saved lse (no [Q, S] matrix kept), accumulates dQ locally, and sends
dK/dV around the ring with their block, one extra hop bringing them home. Tiles run in fp32
(inputs in bf16 keep their dtype outside).
"""
import math

import torch
import torch.distributed as dist

from .split import chunk_ids


def _ring_peers(group):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return (dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n))


def _start_pass(tensors: list, group):
    """Issue: send `tensors` to the next rank, receive the previous rank's; -> (received, works)."""
    nxt, prv = _ring_peers(group)
    tensors = [t.contiguous() for t in tensors]
    recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recv]
    return recv, dist.batch_isend_irecv(ops)


def _finish(works) -> None:
    for w in works:
        w.wait()


def _tiles(n: int, r: int, src: int, causal: bool) -> list:
    """(query half, key half, diagonal) chunk pairs rank r computes against rank src's block:
    each rank holds 2 chunks (split.py), a causal pair runs only if the key chunk is not after
    the query chunk (every rank then computes 2n+1 pairs: split.attention_work); a diagonal
    pair takes the causal mask inside the chunk."""
    mine, theirs = chunk_ids(n, r), chunk_ids(n, src)
    return [(a, b, causal and qc == kc) for a, qc in enumerate(mine) for b, kc in enumerate(theirs)
            if not causal or kc <= qc]


def _scores(q, k, scale, diagonal: bool, row0: int):
    """Scores of query rows [row0, row0 + R) of a chunk against a key chunk; on a diagonal
    pair key j is masked for query row i when j > i."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:
        rows = torch.arange(row0, row0 + s.shape[-2], device=s.device)
        cols = torch.arange(s.shape[-1], device=s.device)
        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    return s


ROWS = 256  # query rows per tile: transient scores [B, H, ROWS, S/2n], linear in S/n


def _row_tiles(C: int) -> list:
    return [(i, min(i + ROWS, C)) for i in range(0, C, ROWS)]


def _merge(out, lse, block_out, block_lse):
    new = torch.logaddexp(lse, block_lse)
    wa = torch.where(torch.isinf(lse), 0.0, torch.exp(lse - new))
    wb = torch.where(torch.isinf(block_lse), 0.0, torch.exp(block_lse - new))
    return out * wa[..., None] + block_out * wb[..., None], new


def _half(t, i: int, C: int):
    return t[..., i * C:(i + 1) * C, :]


class _RingAttention(torch.autograd.Function):
    """Shapes inside: C = Q/2 tokens per chunk; score tiles [B, H, ROWS, C] at most."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        scale, C = 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2
        q32, kv = q.float(), [k.float(), v.float()]
        half_BHCV = _half(q32, 0, C).shape[:-1] + (v.shape[-1],)  # values may be narrower (mla)
        outs = [torch.zeros(half_BHCV, device=q.device) for _ in range(2)]
        lses = [torch.full(outs[0].shape[:-1], float("-inf"), device=q.device) for _ in range(2)]
        for step in range(n):
            pending = _start_pass(kv, group) if step < n - 1 else None
            for a, b, diagonal in _tiles(n, r, (r - step) % n, causal):
                kb, vb = _half(kv[0], b, C), _half(kv[1], b, C)
                for i, j in _row_tiles(C):
                    s = _scores(_half(q32, a, C)[..., i:j, :], kb, scale, diagonal, i)
                    tile_lse = torch.logsumexp(s, dim=-1)
                    p = torch.exp(s - tile_lse[..., None])
                    o, l_ = _merge(outs[a][..., i:j, :], lses[a][..., i:j], torch.matmul(p, vb), tile_lse)
                    outs[a][..., i:j, :], lses[a][..., i:j] = o, l_
            if pending is not None:
                kv, works = pending
                _finish(works)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, n, r = ctx.group, dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        C = q.shape[2] // 2
        q32, d_out = q.float(), d_out.float()
        D = (d_out * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q32)
        blk = [k.float(), v.float(), torch.zeros(k.shape, device=k.device),
               torch.zeros(v.shape, device=v.device)]
        for step in range(n):
            kk, vv, dk, dv = blk
            for a, b, diagonal in _tiles(n, r, (r - step) % n, ctx.causal):
                kb, vb = _half(kk, b, C), _half(vv, b, C)
                for i, j in _row_tiles(C):
                    qa = _half(q32, a, C)[..., i:j, :]
                    do_a = _half(d_out, a, C)[..., i:j, :]
                    lse_a = _half(lse[..., None], a, C)[..., i:j, :]
                    p = torch.exp(_scores(qa, kb, ctx.scale, diagonal, i) - lse_a)
                    _half(dv, b, C).add_(torch.matmul(p.transpose(-1, -2), do_a))
                    ds = p * (torch.matmul(do_a, vb.transpose(-1, -2)) - _half(D, a, C)[..., i:j, :])
                    _half(dq, a, C)[..., i:j, :].add_(torch.matmul(ds, kb) * ctx.scale)
                    _half(dk, b, C).add_(torch.matmul(ds.transpose(-1, -2), qa) * ctx.scale)
            # the last hop carries only the gradients home (rank r+1 owns what r holds now)
            send = [kk, vv, dk, dv] if step < n - 1 else [dk, dv]
            recv, works = _start_pass(send, group)
            _finish(works)
            blk = recv if step < n - 1 else [None, None, *recv]
        _, _, dk, dv = blk
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q_BHQD, k_BHKD, v_BHKD, group, causal: bool = True, seq_len: int = None):
    """Attention of this rank's queries over the whole (split) sequence -> [B, H, Q, Dh].

    q, k, v hold this rank's tokens in the balanced order of split.py; seq_len is the whole
    sequence length (default: n x the local length). Every rank of `group` must call it
    (and its backward) with the same shapes."""
    n = dist.get_world_size(group)
    if seq_len is not None and seq_len != q_BHQD.shape[2] * n:
        raise ValueError(f"ring attention: seq_len={seq_len} is not cp={n} x the local "
                         f"{q_BHQD.shape[2]} tokens")
    return _RingAttention.apply(q_BHQD, k_BHKD, v_BHKD, group, causal)
