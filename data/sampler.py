"""Memory-mapped token files and the deterministic, resumable batch sampler.

Shapes: B sequences, S sequence length (a sample holds S+1 tokens: inputs and shifted targets).

The sampler defines the GLOBAL batch of every optimizer step from (seed, position) alone:
epoch e visits all sequences in the order of a permutation seeded by (seed, e), and
`position` counts sequences consumed so far. Data-parallel rank r of P takes rows
[r*B/P, (r+1)*B/P) of each global batch, so any layout sees the same global batch, and
resuming only needs `position`.
"""
import json
from pathlib import Path

import numpy as np
import torch


class TokenFile:
    """A flat token file viewed as non-overlapping samples of S+1 tokens (memory-mapped)."""

    def __init__(self, path, dtype: str, seq_len: int):
        self.path, self.seq_len = Path(path), seq_len
        self.tokens = np.memmap(self.path, dtype=np.dtype(dtype), mode="r")
        self.num_sequences = (len(self.tokens) - 1) // seq_len
        if self.num_sequences < 1:
            raise ValueError(f"{self.path} holds {len(self.tokens)} tokens, fewer than one "
                             f"sample of data.seq_len+1={seq_len + 1}; lower data.seq_len or add data")

    def batch(self, indices) -> torch.Tensor:
        """int64 tensor [len(indices), S+1]."""
        S = self.seq_len
        rows = [np.asarray(self.tokens[i * S: i * S + S + 1], dtype=np.int64) for i in indices]
        return torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, S + 1, dtype=torch.int64)


def open_split(data_dir, split: str, seq_len: int) -> TokenFile:
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    return TokenFile(Path(data_dir) / f"{split}.bin", meta["dtype"], seq_len)


def shard_rows(global_batch: int, dp_rank: int, dp_size: int) -> slice:
    """This rank's rows of a global batch (an error, not a silent remainder, if uneven)."""
    if global_batch % dp_size != 0:
        raise ValueError(f"train.batch_size={global_batch} is not divisible by the data-parallel "
                         f"degree {dp_size}; use a multiple of {dp_size}")
    n = global_batch // dp_size
    return slice(dp_rank * n, (dp_rank + 1) * n)


class BatchSampler:
    """Yields this rank's share of successive global batches of sequence indices."""

    def __init__(self, num_sequences: int, global_batch: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1, position: int = 0):
        if num_sequences < 1 or global_batch < 1:
            raise ValueError(f"need num_sequences >= 1 and global_batch >= 1, "
                             f"got {num_sequences}, {global_batch}")
        self.num_sequences, self.global_batch, self.seed = num_sequences, global_batch, seed
        self.rows = shard_rows(global_batch, dp_rank, dp_size)
        self.position = position
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:  # cache one epoch: consecutive batches share it
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.num_sequences), epoch
        return self._perm

    def global_indices(self, position: int, count: int) -> np.ndarray:
        out = []
        while count > 0:
            epoch, offset = divmod(position, self.num_sequences)
            take = min(count, self.num_sequences - offset)
            out.append(self._permutation(epoch)[offset: offset + take])
            position, count = position + take, count - take
        return np.concatenate(out)

    def next_indices(self) -> np.ndarray:
        """This rank's indices of the next global batch; advances the position."""
        idx = self.global_indices(self.position, self.global_batch)[self.rows]
        self.position += self.global_batch
        return idx

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed,
                "num_sequences": self.num_sequences, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state["num_sequences"] != self.num_sequences or state["seed"] != self.seed:
            raise ValueError(f"the checkpoint's data sampler saw {state['num_sequences']} "
                             f"sequences with seed {state['seed']}, this run has "
                             f"{self.num_sequences} with seed {self.seed}: the data or "
                             f"data.seq_len/train.seed changed; resume with the same settings")
        self.position = int(state["position"])


def eval_indices(num_sequences: int, count: int, dp_rank: int, dp_size: int) -> np.ndarray:
    """A fixed, evenly spread set of `count` validation sequences; this rank's share."""
    count = min(count, num_sequences)
    count -= count % dp_size
    if count == 0:
        raise ValueError(f"the validation split has {num_sequences} sequences, fewer than the "
                         f"{dp_size} data-parallel ranks; lower data.seq_len or add data")
    idx = np.linspace(0, num_sequences - 1, count).round().astype(np.int64)
    return idx[shard_rows(count, dp_rank, dp_size)]
