"""The divergence guard under torchrun (2 data-parallel ranks): train.lr=1e6 makes the
gradient norm non-finite from step 3 on; every rank skips those steps together, the run stops
after train.max_skipped_steps of them with exit 3 and one line naming the step, and the last
checkpoint written before the divergence is kept (no checkpoint is written during it)."""
import pytest

from tests.e2e.test_train import TINY, cache, records, train  # noqa: F401 - cache is a fixture

pytestmark = pytest.mark.e2e


# train.step_checks=device: decided on the device (fused AdamW's found_inf, the verdict
# all-reduced on the device), read at each checkpoint (checkpoint.every=1: every step)
# (tp2: DTensor parameters, the verdict taken as a replicated scalar)
@pytest.mark.parametrize("checks, layout", [("host", "parallel.dp=2"), ("device", "parallel.dp=2"),
                                            ("device", "parallel.tp=2")])
def test_lr_1e6_stops_with_the_step_named_and_keeps_the_good_checkpoint(tmp_path, cache, checks, layout):
    run = tmp_path / "run"
    out = train(TINY + [f"data.cache_dir={cache}", f"run.dir={run}", layout,
                        f"train.step_checks={checks}",
                        "train.lr=1e6", "train.steps=30", "checkpoint.every=1", "checkpoint.keep=1",
                        "train.max_skipped_steps=3"], tmp_path, nproc=2, check=False)
    recs = records(run)
    skipped = [r["step"] for r in recs if r["skipped"]]
    assert skipped and skipped == list(range(skipped[0], skipped[0] + 3)), skipped  # 3 in a row
    last = skipped[-1]
    assert recs[-1]["step"] == last  # stopped right there
    assert all(r["grad_norm"] is None and r["skip_reason"] == "non-finite loss or gradient norm"
               for r in recs if r["skipped"])
    line = (f"error: training diverged: non-finite loss or gradient norm in 3 consecutive steps, "
            f"the last at step {last}")
    assert line in out.stderr and "exitcode  : 3" in out.stderr, out.stderr[-3000:]
    good = run / "checkpoints" / f"step_{skipped[0] - 1:08d}"
    assert [p.name for p in (run / "checkpoints").iterdir()] == [good.name]  # kept, nothing newer
    assert (good / "COMPLETE").is_file() and f"last good checkpoint: {good}" in out.stderr
