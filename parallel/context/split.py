"""The load-balanced sequence split of context parallelism.

Shapes: B batch, S whole sequence, n = cp ranks, C = S / (2n) tokens per chunk.
The sequence is cut into 2n chunks and rank r holds chunks r and 2n-1-r (in that order), so
under a causal mask every rank does the same attention work: chunk c attends to c+1 chunks,
and (r + 1) + (2n - r) = 2n + 1 for every r. A contiguous split (rank r holds chunks 2r and
2r+1) gives the last rank 4n-1 chunk pairs against the first rank's 3: about twice the mean.
"""
import torch


def chunk_ids(cp: int, rank: int) -> list:
    """The chunks (of 2*cp) rank `rank` holds, in its local order."""
    return [rank, 2 * cp - 1 - rank]


def positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [S/n] of this rank's tokens, in its local order."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism: sequence length {seq_len} is not divisible by "
                         f"2 x parallel.cp = {2 * cp}; pick data.seq_len as a multiple of {2 * cp}")
    C = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * C, (c + 1) * C, device=device) for c in chunk_ids(cp, rank)])


def split(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor (sequence along `dim`)."""
    idx = positions(x.shape[dim], cp, rank, x.device)
    return x.index_select(dim, idx)


def attention_work(cp: int, rank: int, balanced: bool = True) -> int:
    """Causal chunk pairs (query chunk, key chunk <= it) rank `rank` computes: its share of
    the attention work, for the balance check (bench and tests)."""
    ids = chunk_ids(cp, rank) if balanced else [2 * rank, 2 * rank + 1]
    return sum(c + 1 for c in ids)
