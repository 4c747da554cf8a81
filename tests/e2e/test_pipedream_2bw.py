"""parallel.pp_schedule=2bw end to end through train.py: it trains (step 1 has no gradient to
apply yet: 2BW's one-step delay), evaluates, and a run resumed from its step-3 checkpoint
(which holds the pending gradient of batch 3) continues exactly as the uninterrupted run
(losses within 1e-5 relative: the same processes, the same order of every sum).
"""
import pytest

from tests.e2e.test_train import TINY, losses, records, resume_after_step3, train

pytestmark = pytest.mark.e2e


@pytest.mark.long
def test_2bw_trains_evaluates_and_resumes_exactly(tmp_path):
    common = TINY + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=6", "checkpoint.every=3",
                     "parallel.pp=2", "parallel.pp_schedule=2bw", "parallel.microbatches=2",
                     "model.tie_embeddings=false", "train.eval_every=3", "train.eval_batches=1"]
    run = tmp_path / "run"
    out = train(common + [f"run.dir={run}"], tmp_path, nproc=2)
    assert "pp_schedule=2bw microbatches=2" in out.stdout + out.stderr
    recs = records(run)
    assert recs[0]["grad_norm"] == 0.0 and all(r["grad_norm"] > 0 for r in recs[1:])
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 6]
    ref = losses(run)
    assert ref[6] < ref[1]
    resume_after_step3(run, common, tmp_path, ref, 1e-5, nproc=2)
