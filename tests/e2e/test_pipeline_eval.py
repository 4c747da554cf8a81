"""Validation loss through a pipeline: train.py under parallel.pp=2 (torchrun, 2 processes)
logs the same val_loss as one process, under 1F1B and under the zero-bubble V schedule zbv
(4 stages, rank 0 holding the first and the last).

A learning rate of 1e-9 keeps the weights (nearly) equal in both runs, so the val_loss can be
compared tightly: 1e-5 relative (only reduction order differs). The task/aux split of the
training loss (read through the runner's stage_aux_loss()) is compared at the same tolerance.
"""
import pytest

from tests.e2e.test_train import TINY, close, records, train

pytestmark = pytest.mark.e2e


def test_pp2_val_loss_matches_one_process(tmp_path_factory, tmp_path):
    cache = tmp_path_factory.mktemp("pp_eval_cache")
    common = TINY + [f"data.cache_dir={cache}", "model.tie_embeddings=false", "train.steps=2",
                     "model.n_layers=4",
                     "train.eval_every=1", "train.eval_batches=2", "train.lr=1e-9",
                     "log.moe_stats_every=0"]
    one, pp = tmp_path / "one", tmp_path / "pp"
    train(common + [f"run.dir={one}"], tmp_path)
    train(common + [f"run.dir={pp}", "parallel.pp=2", "parallel.dp=1", "parallel.microbatches=2"],
          tmp_path, nproc=2)
    zbv = tmp_path / "zbv"
    out = train(common + [f"run.dir={zbv}", "parallel.pp=2", "parallel.dp=1",
                          "parallel.microbatches=2", "parallel.pp_schedule=zbv"], tmp_path, nproc=2)
    assert "pp_schedule=zbv microbatches=2" in out.stdout + out.stderr
    ref = records(one)
    for got in (records(pp), records(zbv)):
        _check_same(ref, got)


def _check_same(ref, got):
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(ref, got):
        assert "val_loss" in b, f"no val_loss under pp at step {b['step']}"
        assert close(a["val_loss"], b["val_loss"], 1e-5), (a["val_loss"], b["val_loss"])
        # step 2 follows an evaluation: evaluating must not disturb training
        assert close(a["loss"], b["loss"], 1e-5), (a["loss"], b["loss"])
        assert close(a["aux_loss"], b["aux_loss"], 1e-5), (a["aux_loss"], b["aux_loss"])
