"""checkpoint.async: rank 0 hashes the checkpoint's files for its manifest only after every
rank's files are written, so a slow writer cannot make a good checkpoint fail verification.

World 2 (dp2, ZeRO-1): rank 1 writes its RNG file slowly (half of it, a pause of 1.5 s, the
rest); the background save of a tiny model finishes long before that pause ends. Before the
fix the RNG files were written after dcp.async_save returned, so rank 0's manifest caught
rank 1's file half-written and a resume rejected the good checkpoint (checked: on that order this test fails
with "rng_rank1.pt has 6633 bytes, the manifest says 3316"). Now each rank writes its
own files before its DCP save begins and rank 0's DCP future ends only after every rank's
save: verify() passes on both ranks, and every file matches.
"""
import functools
import io
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist


def _slow_rng_save(real_save, obj, f, *args, **kwargs):
    """torch.save, but an RNG file of a checkpoint is written in two halves 1.5 s apart."""
    if not str(f).endswith(".pt") or "rng_rank" not in str(f):
        return real_save(obj, f, *args, **kwargs)
    buf = io.BytesIO()
    real_save(obj, buf, *args, **kwargs)
    data = buf.getvalue()
    with open(f, "wb") as out:
        out.write(data[:len(data) // 2])
        out.flush()
        time.sleep(1.5)
        out.write(data[len(data) // 2:])


def _worker(rank, world, run_dir):
    from parallel.apply import parallelize
    from parallel.mesh import build_meshes
    from parallel.plan import ParallelPlan
    from trainer import checkpoint
    from trainer.distributed import DistContext
    model_cfg, moe_cfg = dc.configs()
    plan = ParallelPlan(dp=world, zero=1).validate(world, model_cfg, moe_cfg, dc.B)
    par = parallelize(dc.make_model(model_cfg, moe_cfg), plan, build_meshes(plan))
    opt = par.prepare_optimizer(dc.adamw_of(par.model))
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    group = dist.new_group(backend="gloo")
    if rank == 1:
        checkpoint.torch.save = functools.partial(_slow_rng_save, torch.save)
    pending = checkpoint.begin_save(ctx, Path(run_dir), 1, par, opt, {"note": "test"},
                                    background=True, group=group)
    final = checkpoint.finish_save(ctx, pending, keep=3)
    dist.barrier()
    return checkpoint.verify(final), sorted(p.name for p in final.iterdir())


def test_a_slow_rank_file_is_in_the_manifest_whole():
    run_dir = tempfile.mkdtemp(prefix="moekit_manifest_")
    results = run_distributed(functools.partial(_worker, run_dir=run_dir), 2, timeout=120)
    for rank, (problem, files) in enumerate(results):
        assert problem == "", f"rank {rank}: {problem}"
        assert {"rng_rank0.pt", "rng_rank1.pt", "trainer.json", "COMPLETE"} <= set(files), files
