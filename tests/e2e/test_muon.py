"""train.optimizer=muon through train.py: the same model, weights and global batch under dp2 x
ep2 (each rank keeps whole experts, the dense matrices whole and all-reduced) and under pp2
(each stage its whole matrices) give the one-process losses for 6 steps (1e-4 relative: the
reduction order, amplified by the steps; docs/torch_distributed_traps.md trap 5); a one-process muon checkpoint of step 3
resumes under dp2 x tp2 x ep2 x ZeRO-3 with the uninterrupted run's losses (Muon's momentum
buffers and AdamW's moments cut into FSDP2's shards of the tensor-parallel blocks and of each
rank's experts, the matrices' updates orthogonalised whole by their owner rank:
parallel/muon.py)."""
import shutil

import pytest

from tests.e2e.launch import prepared_cache, run_all
from tests.e2e.test_train import TINY, close, losses, train

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return prepared_cache(tmp_path_factory, "muon_cache", TINY)


@pytest.mark.long
def test_muon_layouts_equal_one_process_and_resume_across_layouts(tmp_path, cache):
    common = TINY + [f"data.cache_dir={cache}", "train.steps=6", "checkpoint.every=3",
                     "train.eval_every=0", "train.optimizer=muon", "moe.every=1"]
    one, ep2, pp2 = tmp_path / "one", tmp_path / "ep2", tmp_path / "pp2"
    results = run_all([(1, common + [f"run.dir={one}"]),
                       (2, common + [f"run.dir={ep2}", "parallel.dp=2", "parallel.ep=2"]),
                       (2, common + [f"run.dir={pp2}", "parallel.pp=2", "parallel.microbatches=2"])],
                      tmp_path)
    for code, log in results:
        assert code == 0, log[-3000:]
    ref = losses(one)
    assert sorted(ref) == [1, 2, 3, 4, 5, 6] and ref[6] < ref[1]
    for run in (ep2, pp2):
        got = losses(run)
        for step in ref:
            assert close(got[step], ref[step], 1e-4), (run.name, step, got[step], ref[step])
    shutil.rmtree(one / "checkpoints" / "step_00000006")
    train(common + [f"run.dir={one}", "train.resume=true", "parallel.dp=2", "parallel.tp=2",
                    "parallel.ep=2", "parallel.zero=3"], tmp_path, nproc=4)
    got = losses(one)
    for step in (4, 5, 6):
        assert close(got[step], ref[step], 1e-4), (step, got[step], ref[step])
