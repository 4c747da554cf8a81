"""parallel.etp end to end through train.py: the same losses as one process, a checkpoint
that holds whole experts (it resumes under etp=1), and the start-up line that says so.

Tolerances as tests/e2e/test_train.py: another layout differs only in reduction order,
losses within 1e-4 relative.
"""
import pytest

from tests.e2e.test_train import TINY, close, losses, resume_after_step3, train

pytestmark = pytest.mark.e2e


def test_etp2_trains_like_one_process_and_resumes_under_etp1(tmp_path):
    common = TINY + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=6", "checkpoint.every=3"]
    one, etp = tmp_path / "one", tmp_path / "etp"
    train(common + [f"run.dir={one}"], tmp_path)
    ref = losses(one)
    # each expert's d_ff split over the 2 ranks, which also split the data; ZeRO-1 slices
    # the optimizer state of those d_ff blocks
    out = train(common + [f"run.dir={etp}", "parallel.dp=2", "parallel.etp=2", "parallel.zero=1"],
                tmp_path, nproc=2)
    assert "dp=2 tp=1 pp=1 ep=1 zero=1 precision=fp32 etp=2" in out.stdout + out.stderr
    got = losses(etp)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step, loss in got.items():
        assert close(loss, ref[step], 1e-4), (step, loss, ref[step])

    # its step-3 checkpoint on one process (etp=1, zero 0): steps 4..6 as uninterrupted
    resume_after_step3(etp, common, tmp_path, ref, 1e-4)
