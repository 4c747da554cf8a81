"""train.py end to end: fp16 loss scaling, and tied embeddings under pipeline parallelism.

fp16: an initial loss scale far too large makes the first step overflow: it must be skipped
(weights equal the seeded init exactly, metrics say skipped, scale halved), the scaler state
must survive a checkpoint, training must go on; dp=2 must equal one fp16 process (losses
within 2e-3 relative: fp16 matmuls on differently split batches round differently).
Tied embeddings: the default (tied) GPT under pp=2 trains with the one-process losses
(1e-4 relative, reduction order only), its checkpoint stores the weight once, as
tok_emb.weight, and resumes in one process.
"""
import json

import pytest
import torch

import models
from tests.e2e.test_train import TINY, close, losses, records, train

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


def _init_model(cfg):
    return models.init_weights(models.build_model(cfg.model, cfg.moe), cfg.train.seed, "cpu")


@pytest.mark.lowp
def test_fp16_overflow_skips_the_step_and_training_continues(tmp_path, cache):
    from parallel.apply import parallelize
    from parallel.plan import ParallelPlan
    from trainer.checkpoint import load_model_weights, read_trainer_state
    from trainer.config import load_config
    run = tmp_path / "fp16"
    args = TINY + [f"data.cache_dir={cache}", f"run.dir={run}", "parallel.precision=fp16",
                   "train.loss_scale_init=1e12"]
    train(args + ["train.steps=1"], tmp_path)
    rec = records(run)[0]
    assert rec["skipped"] is True and rec["grad_norm"] is None and rec["loss_scale"] == 1e12
    ckpt = run / "checkpoints" / "step_00000001"
    assert read_trainer_state(ckpt)["loss_scaler"]["scale"] == 5e11  # halved
    # the skipped step left the weights exactly at the seeded init
    cfg = load_config(None, args)
    init, loaded = _init_model(cfg), _init_model(cfg)
    with torch.no_grad():
        for p in loaded.parameters():
            p.add_(1.0)  # so the check below cannot pass by accident
    load_model_weights(ckpt, parallelize(loaded, ParallelPlan().validate(1)))
    for (name, a), b in zip(init.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name

    out = train(args + ["train.steps=30", "train.resume=true", "log.progress=plain"], tmp_path)
    recs = records(run)
    assert [r["step"] for r in recs] == list(range(1, 31))
    scales = [r["loss_scale"] for r in recs]
    assert all(b == a / 2 for a, b, r in zip(scales, scales[1:], recs) if r["skipped"])
    assert "fp16 gradient overflow, step skipped" in out.stdout
    clean = [r for r in recs if not r["skipped"]]
    assert len(clean) >= 5 and all(r["grad_norm"] > 0 for r in clean)  # it recovered
    assert clean[-1]["loss"] < recs[0]["loss"] - 0.1  # and trains


@pytest.mark.lowp
def test_fp16_two_processes_equal_one(tmp_path, cache):
    common = TINY + [f"data.cache_dir={cache}", "train.steps=4", "parallel.precision=fp16"]
    one, two = tmp_path / "one", tmp_path / "two"
    train(common + [f"run.dir={one}"], tmp_path)
    train(common + [f"run.dir={two}", "parallel.dp=2"], tmp_path, nproc=2)
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert close(a[step], b[step], 2e-3), (step, a[step], b[step])
    assert all(not r["skipped"] for r in records(two))


def test_tied_embeddings_under_pipeline_parallelism(tmp_path, cache):
    from torch.distributed.checkpoint import FileSystemReader
    common = TINY + [f"data.cache_dir={cache}", "train.steps=4", "model.tie_embeddings=true",
                     "model.n_layers=4", "parallel.microbatches=2"]
    one, pp = tmp_path / "one", tmp_path / "pp"
    train(common + [f"run.dir={one}"], tmp_path)
    train(common + [f"run.dir={pp}", "parallel.pp=2", "checkpoint.every=2"], tmp_path, nproc=2)
    a, b = losses(one), losses(pp)
    for step in a:
        assert close(a[step], b[step], 1e-4), (step, a[step], b[step])
    meta = FileSystemReader(str(pp / "checkpoints" / "step_00000004")).read_metadata()
    names = {k.split(".", 1)[1] for k in meta.state_dict_metadata if k.startswith("model.")}
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # stored once
    # the pp=2 checkpoint of step 2 resumes in one process and continues as the 1-process run
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    import shutil
    shutil.copytree(pp / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    train(common + [f"run.dir={resumed}", "train.resume=true"], tmp_path)
    c = losses(resumed)
    assert sorted(c) == [3, 4]
    for step in c:
        assert close(a[step], c[step], 1e-4), (step, a[step], c[step])
