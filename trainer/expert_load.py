"""Expert-load profiles written by train.py at intervals (log.profile_every).

Every rank runs the same number of held-out batches (under expert parallelism the forward
is a collective), each its own data-parallel share; rank 0 writes
run.dir/profile/step_NNNNNNN/{load.json, load.png} and logs the heatmap and per-layer load
histograms to TensorBoard. The counts are those of rank 0's share of the held-out batches:
a sample of the same distribution the whole run sees (documented in README).
"""
from pathlib import Path

import torch

from moe.profiling import profile_model

from .evaluation import held_out


@torch.no_grad()
def profile_at_step(trainer, step: int) -> dict:
    cfg, layout = trainer.cfg, trainer.par
    chunks = held_out(trainer.val_file, trainer.task, cfg.log.profile_batches,
                      cfg.train.batch_size, layout.dp_rank, layout.dp_size)
    batches = (trainer.task.model_inputs(batch) for _, batch in chunks)
    out_dir = Path(cfg.run.dir) / "profile" / f"step_{step:07d}" if trainer.ctx.is_main else None
    writer = trainer.log.tb if trainer.ctx.is_main else None
    return profile_model(trainer.model, batches, out_dir, writer=writer, step=step)
