"""train.py with context parallelism: cp=2 (ring) with its experts folded over the cp pair
(ep=2, 2 processes) trains like one process, evaluates like it, and its checkpoint resumes
under cp=1 (one process) and the one-process checkpoint under cp=2 ulysses.

Tolerance: 1e-4 relative on losses (reduction order only; AdamW amplifies ~1e-7 differences,
docs/torch_distributed_traps.md trap 5). The layout line names cp and its mode.
"""
import shutil

import pytest

from tests.e2e.test_train import TINY, close, losses, records, train

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")
ARGS = TINY + ["train.steps=6", "checkpoint.every=3", "train.eval_every=3",
               "log.progress=plain", "log.tensorboard=false"]


@pytest.mark.long
def test_cp2_trains_like_one_process_and_checkpoints_move_across_cp(tmp_path, cache):
    env = [f"data.cache_dir={cache}"]
    one, cp = tmp_path / "one", tmp_path / "cp"
    train(ARGS + env + [f"run.dir={one}"], tmp_path)
    out = train(ARGS + env + [f"run.dir={cp}", "parallel.cp=2", "parallel.ep=2"], tmp_path, nproc=2)
    assert "cp=2 cp_mode=ring" in out.stdout + out.stderr
    ref, got = losses(one), losses(cp)
    assert sorted(got) == list(range(1, 7))
    for s in ref:
        assert close(got[s], ref[s], 1e-4), f"step {s}: cp=2 {got[s]} vs one process {ref[s]}"
    val = {r["step"]: r["val_loss"] for r in records(one) if "val_loss" in r}
    cp_val = {r["step"]: r["val_loss"] for r in records(cp) if "val_loss" in r}
    assert sorted(val) == sorted(cp_val) == [3, 6]
    assert all(close(cp_val[s], val[s], 1e-4) for s in val), (cp_val, val)
    # the cp=2 checkpoint at step 3 resumes in one process with the uninterrupted losses
    shutil.rmtree(cp / "checkpoints" / "step_00000006")
    train(ARGS + env + [f"run.dir={cp}", "train.resume=true"], tmp_path)
    resumed = losses(cp)
    assert all(close(resumed[s], ref[s], 1e-4) for s in (4, 5, 6)), (resumed, ref)
    # and the one-process checkpoint resumes under cp=2 ulysses
    shutil.rmtree(one / "checkpoints" / "step_00000006")
    train(ARGS + env + [f"run.dir={one}", "train.resume=true", "parallel.cp=2",
                        "parallel.cp_mode=ulysses"], tmp_path, nproc=2)
    back = losses(one)
    assert all(close(back[s], ref[s], 1e-4) for s in (4, 5, 6)), (back, ref)


@pytest.mark.lowp
def test_cp2_in_bf16_tracks_one_process_in_bf16(tmp_path, cache):
    """parallel.precision=bf16 under cp=2 (Ulysses: attention itself in bf16, as in one
    process): losses within 1e-2 relative of one process in bf16 over 4 steps (bf16 keeps 8
    mantissa bits; the layouts round different partial sums)."""
    args = TINY + ["train.steps=4", "train.eval_every=0", "log.progress=none",
                   "log.tensorboard=false", "parallel.precision=bf16", f"data.cache_dir={cache}"]
    one, cp = tmp_path / "one", tmp_path / "cp"
    train(args + [f"run.dir={one}"], tmp_path)
    train(args + [f"run.dir={cp}", "parallel.cp=2", "parallel.cp_mode=ulysses"], tmp_path, nproc=2)
    ref, got = losses(one), losses(cp)
    assert sorted(got) == [1, 2, 3, 4]
    for s in ref:
        assert close(got[s], ref[s], 1e-2), f"step {s}: cp=2 bf16 {got[s]} vs one process {ref[s]}"
