"""Held-out batches, one way for every reader: the periodic evaluation, the periodic expert-
load profile (expert_load.py), and the profiler command (`python -m trainer.profile`).

Shapes: B sequences per chunk, S sequence length.
`held_out(val_file, task, batches, batch_size, dp_rank, dp_size, chunk)` takes a fixed,
evenly spread set of batches x batch_size validation sequences (data.sampler.eval_indices),
this data-parallel rank's share of them, and yields (row count, prepared batch) chunk by
chunk: the same sequences on every run and every layout.
"""
from data.sampler import eval_indices


def held_out(val_file, task, batches: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
             chunk: int = 0, whole_chunks: bool = False):
    """Yield (rows, batch prepared by `task`) over this rank's share of the held-out set, in
    chunks of `chunk` rows (0: batch_size / dp_size). whole_chunks drops a short last chunk
    (a pipeline splits each chunk into its fixed micro-batch count) unless that leaves none."""
    idx = eval_indices(val_file.num_sequences, batches * batch_size, dp_rank, dp_size)
    chunk = chunk or max(1, batch_size // dp_size)
    if whole_chunks and len(idx) >= chunk:
        idx = idx[:len(idx) - len(idx) % chunk]
    for i in range(0, len(idx), chunk):
        rows = idx[i:i + chunk]
        yield len(rows), task.prepare(val_file.batch(rows), rows)
