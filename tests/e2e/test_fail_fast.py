"""Failing fast under torchrun: an error on one rank ends every rank within seconds (not
run.dist_timeout_s), and that rank's one line is the root cause in torchrun's summary."""
import time

import pytest

from tests.e2e.test_train import TINY, cache, train  # noqa: F401 - cache is a fixture

pytestmark = pytest.mark.e2e


def test_error_on_rank1_only_ends_the_job_quickly(tmp_path, cache):
    run = tmp_path / "run"
    common = TINY + [f"data.cache_dir={cache}", f"run.dir={run}", "parallel.dp=2"]
    train(common + ["train.steps=2"], tmp_path, nproc=2)
    ckpt = run / "checkpoints" / "step_00000002"
    (ckpt / "rng_rank1.pt").write_bytes(b"not a pickle")  # only rank 1 reads this file
    (ckpt / "manifest.json").unlink(missing_ok=True)     # as a checkpoint from before manifests
    for attempt in range(2):  # a launch that never reached train.py (torchrun's own start-up
        t0 = time.monotonic()  # failing on a busy machine: no "run dir:" line) is tried again
        out = train(common + ["train.steps=4", "train.resume=true", "run.dist_timeout_s=300"],
                    tmp_path, nproc=2, check=False)
        took = time.monotonic() - t0
        if "run dir:" in out.stdout:
            break
    assert out.returncode != 0
    assert "Root Cause" in out.stderr, out.stdout[-2000:] + out.stderr[-4000:]
    summary = out.stderr[out.stderr.index("Root Cause"):]
    assert "rank      : 1" in summary and "rng_rank1.pt is unreadable" in summary, summary
    assert took < 60, f"took {took:.0f}s: a rank waited for the process-group timeout"


def test_validation_split_smaller_than_dp_is_refused_before_step_1(tmp_path):
    run = tmp_path / "run"
    # 100 KB of text in 4096-token sequences: one validation sequence for two dp ranks
    out = train(TINY + [f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={run}", "parallel.dp=2",
                        "data.max_bytes=100000", "data.seq_len=4096", "model.max_seq_len=4096",
                        "train.batch_size=2", "train.eval_every=2", "train.steps=2"],
                tmp_path, nproc=2, check=False)
    line = "error: the validation split has 1 sequence(s) of 4096 tokens, fewer than the 2 data-parallel"
    assert out.returncode != 0 and line in out.stderr[out.stderr.index("Root Cause"):], out.stderr[-3000:]
    assert not (run / "metrics.jsonl").exists()  # refused before the first step
