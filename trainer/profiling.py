"""Expert-load profiles written by train.py at intervals (log.profile_every).

Every rank runs the same number of held-out batches (under expert parallelism the forward
is a collective), each its own data-parallel share; rank 0 writes
run.dir/profile/step_NNNNNNN/{load.json, load.png} and logs the heatmap and per-layer load
histograms to TensorBoard. The counts are those of rank 0's share of the held-out batches:
a sample of the same distribution the whole run sees (documented in README).
"""
from pathlib import Path

import torch

from data.sampler import eval_indices
from moe.profiling import profile_model


def model_inputs(task_arch: str, batch):
    """What the model's forward takes, from a prepared batch (see trainer/tasks.py)."""
    if task_arch == "switch":
        return batch["input_ids"], batch["decoder_input_ids"]
    return batch[:, :-1]


@torch.no_grad()
def profile_at_step(trainer, step: int) -> dict:
    cfg, layout = trainer.cfg, trainer.par
    bs = cfg.train.batch_size // layout.dp_size
    count = cfg.log.profile_batches * cfg.train.batch_size
    idx = eval_indices(trainer.val_file.num_sequences, count, layout.dp_rank, layout.dp_size)
    chunks = [idx[i:i + bs] for i in range(0, len(idx), bs)]
    batches = (model_inputs(trainer.task.arch, trainer.task.prepare(trainer.val_file.batch(c), c))
               for c in chunks)
    out_dir = Path(cfg.run.dir) / "profile" / f"step_{step:07d}" if trainer.ctx.is_main else None
    writer = trainer.log.tb if trainer.ctx.is_main else None
    return profile_model(trainer.model, batches, out_dir, writer=writer, step=step)
