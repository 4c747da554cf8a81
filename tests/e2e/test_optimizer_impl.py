"""train.optimizer_impl end to end: fused AdamW (torch's kernel, on CPU here) trains the same
losses as the per-parameter loop (1e-5 relative over 3 steps: the same fp32 operations in
another order), and a non-AdamW optimizer with an explicit implementation is refused in one
line naming the field."""
import pytest

from tests.e2e.test_train import TINY, close, losses, train

pytestmark = pytest.mark.e2e


def test_fused_adamw_trains_like_the_loop(tmp_path):
    common = TINY + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=3",
                     "checkpoint.every=0", "checkpoint.at_end=false"]
    runs = {}
    for impl in ("for_loop", "fused"):
        train(common + [f"run.dir={tmp_path / impl}", f"train.optimizer_impl={impl}"], tmp_path)
        runs[impl] = losses(tmp_path / impl)
    assert sorted(runs["fused"]) == [1, 2, 3]
    for step, ref in runs["for_loop"].items():
        assert close(runs["fused"][step], ref, 1e-5), (step, runs["fused"][step], ref)
    refused = train(common + [f"run.dir={tmp_path / 'af'}", "train.optimizer=adafactor",
                              "train.optimizer_impl=fused"], tmp_path, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "train.optimizer_impl='fused' picks torch AdamW's implementation" in refused.stderr
