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


def test_fused_and_foreach_adamw_under_tp2(tmp_path):
    """tp2 holds DTensor weights beside plain norms and routers: torch's fused and foreach
    AdamW update them in one call per device and dtype, which DTensor refused for the mix
    ("got mixed torch.Tensor and DTensor"; optimizer_impl=auto takes fused on every CUDA tp
    run). parallel.dtensors.step_with_plain_replicated runs the step with the plain tensors
    taken as replicated: both train the per-parameter loop's losses (1e-5 over 3 steps)."""
    common = TINY + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=3", "parallel.dp=1",
                     "parallel.tp=2", "checkpoint.every=0", "checkpoint.at_end=false"]
    runs = {}
    for impl in ("for_loop", "fused", "foreach"):
        train(common + [f"run.dir={tmp_path / impl}", f"train.optimizer_impl={impl}"], tmp_path, nproc=2)
        runs[impl] = losses(tmp_path / impl)
    for impl in ("fused", "foreach"):
        assert sorted(runs[impl]) == [1, 2, 3]
        for step, ref in runs["for_loop"].items():
            assert close(runs[impl][step], ref, 1e-5), (impl, step, runs[impl][step], ref)
