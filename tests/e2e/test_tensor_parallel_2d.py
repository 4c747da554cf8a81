"""parallel.tp_mode=2d end to end through train.py: the same losses as one process on a
2 x 2 grid (with ep x etp experts, ZeRO-1 and recomputation; and in bf16), and a checkpoint
that holds whole matrices, so the run resumes under 1-D tp=2 and under one process with the
uninterrupted run's losses.

Tolerances as tests/e2e/test_train.py: another layout differs only in reduction order,
losses within 1e-4 relative in fp32; bf16 within 1e-3 (its matmuls round per partial sum).
"""
import shutil

import pytest

from tests.e2e.test_train import TINY, close, losses, resume_after_step3, train

pytestmark = pytest.mark.e2e


@pytest.mark.long
def test_2d_trains_like_one_process_and_resumes_under_1d_and_one_process(tmp_path):
    common = TINY + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=6", "checkpoint.every=3"]
    one, grid = tmp_path / "one", tmp_path / "grid"
    train(common + [f"run.dir={one}"], tmp_path)
    ref = losses(one)
    # the grid with experts over ep x etp, the overlapped all-to-all, ZeRO-1 and
    # recomputation (none changes the function)
    out = train(common + [f"run.dir={grid}", "parallel.tp=4", "parallel.tp_mode=2d", "parallel.zero=1",
                          "parallel.ep=2", "parallel.etp=2", "parallel.recompute=full",
                          "moe.a2a_overlap_degree=2"], tmp_path, nproc=4)
    assert "dp=1 tp=4 pp=1 ep=2 zero=1 precision=fp32 tp_mode=2d etp=2 recompute=full" in out.stdout + out.stderr
    got = losses(grid)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step, loss in got.items():
        assert close(loss, ref[step], 1e-4), (step, loss, ref[step])

    # the same step-3 checkpoint under 1-D tp=2 (sequence parallel) and under one process
    copy = tmp_path / "grid_copy"
    shutil.copytree(grid, copy)
    resume_after_step3(grid, common + ["parallel.tp=2"], tmp_path, ref, 1e-4, nproc=2)
    resume_after_step3(copy, common, tmp_path, ref, 1e-4)


@pytest.mark.lowp
@pytest.mark.long
def test_2d_in_bf16_trains_like_one_process(tmp_path):
    common = TINY + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=4", "parallel.precision=bf16",
                     "checkpoint.at_end=false"]
    one, grid = tmp_path / "one", tmp_path / "grid"
    train(common + [f"run.dir={one}"], tmp_path)
    train(common + [f"run.dir={grid}", "parallel.tp=4", "parallel.tp_mode=2d"], tmp_path, nproc=4)
    ref, got = losses(one), losses(grid)
    assert sorted(got) == [1, 2, 3, 4]
    for step, loss in got.items():
        assert close(loss, ref[step], 1e-3), (step, loss, ref[step])
