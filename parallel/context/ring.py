"""Ring attention: exact attention over a sequence split across the cp ranks.

Shapes: B batch, H heads, Q local query tokens, K local key tokens (Q = K = S/n), Dh head dim,
n = cp ranks. Each rank keeps its queries; the key/value blocks travel around the ring, rank r
sending to r+1 and receiving from r-1, the next block's send/recv issued before the current
block is computed. Block results are merged exactly with the log-sum-exp rule:
    lse = logaddexp(lse_a, lse_b),  out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)
Causality is decided by global positions (split.py), so any chunk order works; the balanced
order makes the work equal. Backward recomputes each block's probabilities from the saved
lse (no [Q, S] matrix kept), accumulates dQ locally, and sends dK/dV around the ring with
their block, one extra hop bringing them home. Blocks run in fp32 (inputs in bf16 keep
their dtype outside).
"""
import math

import torch
import torch.distributed as dist

from .split import positions


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


def _scores(q, k, q_pos, k_pos, scale, causal):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
    return s


def _merge(out, lse, block_out, block_lse):
    new = torch.logaddexp(lse, block_lse)
    wa = torch.where(torch.isinf(lse), 0.0, torch.exp(lse - new))
    wb = torch.where(torch.isinf(block_lse), 0.0, torch.exp(block_lse - new))
    return out * wa[..., None] + block_out * wb[..., None], new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, seq_len):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        q32, kv = q.float(), [k.float(), v.float()]
        q_pos = positions(seq_len, n, r, q.device)
        out = torch.zeros_like(q32)
        lse = torch.full(q32.shape[:-1], float("-inf"), device=q.device)
        for step in range(n):
            pending = _start_pass(kv, group) if step < n - 1 else None
            k_pos = positions(seq_len, n, (r - step) % n, q.device)
            s = _scores(q32, kv[0], q_pos, k_pos, scale, causal)
            block_lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - torch.where(torch.isinf(block_lse), 0.0, block_lse)[..., None])
            out, lse = _merge(out, lse, torch.matmul(p, kv[1]), block_lse)
            if pending is not None:
                kv, works = pending
                _finish(works)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.seq_len, ctx.scale = group, causal, seq_len, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, n, r = ctx.group, dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        q32, d_out = q.float(), d_out.float()
        q_pos = positions(ctx.seq_len, n, r, q.device)
        D = (d_out * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q32)
        blk = [k.float(), v.float(), torch.zeros(k.shape, device=k.device),
               torch.zeros(v.shape, device=v.device)]
        for step in range(n):
            kk, vv, dk, dv = blk
            k_pos = positions(ctx.seq_len, n, (r - step) % n, q.device)
            s = _scores(q32, kk, q_pos, k_pos, ctx.scale, ctx.causal)
            p = torch.exp(s - lse[..., None])           # masked entries: exp(-inf) = 0
            dv = dv + torch.matmul(p.transpose(-1, -2), d_out)
            ds = p * (torch.matmul(d_out, vv.transpose(-1, -2)) - D)
            dq = dq + torch.matmul(ds, kk) * ctx.scale
            dk = dk + torch.matmul(ds.transpose(-1, -2), q32) * ctx.scale
            # the last hop carries only the gradients home (rank r+1 owns what r holds now)
            send = [kk, vv, dk, dv] if step < n - 1 else [dk, dv]
            recv, works = _start_pass(send, group)
            _finish(works)
            blk = recv if step < n - 1 else [None, None, *recv]
        _, _, dk, dv = blk
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q_BHQD, k_BHKD, v_BHKD, group, causal: bool = True, seq_len: int = None):
    """Attention of this rank's queries over the whole (split) sequence -> [B, H, Q, Dh].

    q, k, v hold this rank's tokens in the balanced order of split.py; seq_len is the whole
    sequence length (default: n x the local length). Every rank of `group` must call it
    (and its backward) with the same shapes."""
    n = dist.get_world_size(group)
    return _RingAttention.apply(q_BHQD, k_BHKD, v_BHKD, group, causal,
                                seq_len or q_BHQD.shape[2] * n)
