"""moe.gates_in_experts through train.py: the gates applied inside the experts train like one
process that weighs the expert outputs in the combine (the default), within tests/e2e/
test_train.py's rule (1e-4 relative, 4 steps), under dp2 x ep2 with the all-to-all overlap
across micro-batches (parallel.a2a_overlap=1f1b: the gates' exchange waits through the same
waiter as the rows') and under dp2 x ep2 with the experts and their activation recomputed
(parallel.recompute_modules=experts,moe_act: the checkpointed experts take the gates too).
"""
import pytest

from tests.e2e.test_train import TINY, cache, close, losses, train  # noqa: F401

pytestmark = pytest.mark.e2e
STEPS = ["train.steps=4", "checkpoint.every=0", "checkpoint.at_end=false"]
GATED = ["moe.gates_in_experts=true", "parallel.dp=2", "parallel.ep=2"]


def test_gates_in_experts_train_like_one_process(tmp_path, cache):
    common = TINY + STEPS + [f"data.cache_dir={cache}"]
    one, lap, rc = tmp_path / "one", tmp_path / "overlap", tmp_path / "recompute"
    train(common + [f"run.dir={one}"], tmp_path)
    train(common + GATED + ["parallel.a2a_overlap=1f1b", "train.micro_batch_size=2",
                            f"run.dir={lap}"], tmp_path, nproc=2)
    train(common + GATED + ["parallel.recompute=selective",
                            "parallel.recompute_modules=experts,moe_act", f"run.dir={rc}"],
          tmp_path, nproc=2)
    ref = losses(one)
    assert sorted(ref) == [1, 2, 3, 4]
    for run in (lap, rc):
        got = losses(run)
        assert sorted(got) == sorted(ref)
        for step in ref:
            assert close(got[step], ref[step], 1e-4), (run.name, step, got[step], ref[step])
