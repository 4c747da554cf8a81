"""train.py end to end: uneven pipeline stages (parallel.pp_layers) and pipeline ranks
without MoE layers under expert parallelism.

- 5 blocks over 2 stages with pp_layers=auto (the start-up line shows the resolved counts)
  trains with the one-process losses, and its checkpoint resumes under "1,4" (1e-4
  relative: reduction order only).
- The issue's command: the default 4-block model, pp=2 interleaved (blocks 0 and 2, both
  dense, on pp rank 0), dp=2, ep=2, trains with the one-process losses (it raised "the model
  has no MoELayer" before).
"""
import pytest

from tests.e2e.test_train import TINY, cache, close, losses, resume_after_step3, train  # noqa: F401 (cache: fixture)

pytestmark = pytest.mark.e2e


@pytest.mark.long
def test_auto_balanced_stages_train_like_one_process_and_resume_under_other_counts(tmp_path, cache):
    common = TINY + [f"data.cache_dir={cache}", "model.n_layers=5", "moe.every=2",
                     "train.steps=6", "checkpoint.every=3", "model.tie_embeddings=false"]
    one, pipe = tmp_path / "one", tmp_path / "pipe"
    train(common + [f"run.dir={one}"], tmp_path)
    pp = ["parallel.pp=2", "parallel.microbatches=2"]
    out = train(common + pp + ["parallel.pp_layers=auto", f"run.dir={pipe}"], tmp_path, nproc=2)
    line = next(s for s in out.stdout.splitlines() if "layout" in s)
    assert "pp_layers=" in line, line
    ref, got = losses(one), losses(pipe)
    assert sorted(got) == list(range(1, 7))
    for step in ref:
        assert close(got[step], ref[step], 1e-4), (step, got[step], ref[step])
    resume_after_step3(pipe, common + pp + ["parallel.pp_layers=1,4"], tmp_path, ref, 1e-4, nproc=2)


@pytest.mark.long
def test_interleaved_pipeline_with_a_dense_rank_under_ep(tmp_path, cache):
    common = [f"data.cache_dir={cache}", "data.max_bytes=1000000", "train.steps=4",
              "train.eval_every=0", "checkpoint.every=0", "model.d_model=32", "model.d_ff=64",
              "data.seq_len=32", "train.batch_size=8", "model.tie_embeddings=false"]
    one, pipe = tmp_path / "one", tmp_path / "pipe"
    train(common + [f"run.dir={one}"], tmp_path)
    layout = ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2",
              "parallel.pp_schedule=interleaved_1f1b", "parallel.microbatches=4"]
    out = train(common + layout + [f"run.dir={pipe}"], tmp_path, nproc=4)
    assert "2 MoE layer(s)" in out.stdout  # the whole model's, not rank 0's stages
    ref, got = losses(one), losses(pipe)
    assert sorted(got) == [1, 2, 3, 4]
    for step in ref:
        assert close(got[step], ref[step], 1e-4), (step, got[step], ref[step])


@pytest.mark.parametrize("layout, shown", [
    (["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_layers=auto"], "pp_layers=0,1,1,0"),
    (["parallel.pp_layers=0,2"], "pp_layers=0,2"),                             # the embedding alone
    (["parallel.pp_layers=2,0", "model.tie_embeddings=true"], "pp_layers=2,0")])  # head and loss alone
def test_stages_without_blocks_train_like_one_process(tmp_path, cache, layout, shown):
    """Megatron's account-for-embedding / -loss split: a first stage holding only the
    embedding, a last one holding only the final norm, head and loss (2 blocks; with a tied
    embedding across the two ends too) train with the one-process losses."""
    common = TINY + [f"data.cache_dir={cache}", "model.n_layers=2", "moe.every=1", "train.steps=4",
                     "checkpoint.every=0", "model.tie_embeddings=false"]
    one, pipe = tmp_path / "one", tmp_path / "pipe"
    tie = [a for a in layout if a.startswith("model.")]
    train(common + tie + [f"run.dir={one}"], tmp_path)
    out = train(common + ["parallel.pp=2", "parallel.microbatches=2"] + layout + [f"run.dir={pipe}"],
                tmp_path, nproc=2)
    assert shown in out.stdout + out.stderr
    ref, got = losses(one), losses(pipe)
    assert sorted(got) == [1, 2, 3, 4]
    for step in ref:
        assert close(got[step], ref[step], 1e-4), (step, got[step], ref[step])
