"""train.optimizer=adafactor end to end: the same losses under dp=2 ep=2 and under ZeRO-3
(dp=2 ep=2, its state offloaded) as one process (1e-4 relative: reduction order only), a
fraction of AdamW's optimizer-state bytes, exact resume, and ZeRO-1/2 refused with one line."""
import pytest

from tests.e2e.test_train import TINY, close, losses, records, train

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.mark.long
def test_adafactor_layouts_state_bytes_and_resume(tmp_path, cache):
    common = TINY + [f"data.cache_dir={cache}", "train.steps=4", "train.optimizer=adafactor"]
    one, two, z3 = tmp_path / "one", tmp_path / "two", tmp_path / "z3"
    train(common + [f"run.dir={one}", "checkpoint.every=2"], tmp_path)
    train(common + [f"run.dir={two}", "parallel.dp=2", "parallel.ep=2"], tmp_path, nproc=2)
    train(common + [f"run.dir={z3}", "parallel.dp=2", "parallel.ep=2", "parallel.zero=3",
                    "parallel.offload=optimizer"], tmp_path, nproc=2)
    a = losses(one)
    for other in (two, z3):
        b = losses(other)
        assert sorted(b) == [1, 2, 3, 4]
        for step in a:
            assert close(a[step], b[step], 1e-4), (other.name, step, a[step], b[step])
    # optimizer state: factored moments vs the 2 x params bytes of AdamW's two moments
    state = records(one)[0]["model_state_bytes"]
    ratio = state["optimizer"]["cpu"] / (2 * state["params"]["cpu"])
    assert 0 < ratio < 0.25, state
    # exact resume from step 2
    resumed = tmp_path / "resumed"
    import shutil
    shutil.copytree(one / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    train(common + [f"run.dir={resumed}", "train.resume=true"], tmp_path)
    c = losses(resumed)
    assert sorted(c) == [3, 4] and all(close(a[s], c[s], 1e-6) for s in c), (a, c)
    for zero in (1, 2):
        refused = train(common + [f"run.dir={tmp_path / f'z{zero}'}", f"parallel.zero={zero}"],
                        tmp_path, check=False)
        assert refused.returncode == 2, refused.stderr
        assert f"train.optimizer='adafactor' cannot run on ZeRO-{zero}" in refused.stderr
