"""train.py with hot-expert replication (moe.replica_slots=1, parallel.ep=2) under torchrun
gives the losses of moe.replica_slots=0, and its TensorBoard shows rows per ep rank nearer
the mean with replication than without. The overlapped exchange (moe.a2a_overlap_degree=4,
with replicas) gives the losses of the plain one.

Tolerance: losses 1e-5 relative (the runs differ only in how an expert's weight gradient is
split into partial sums before AdamW, which amplifies last-bit differences,
docs/torch_distributed_traps.md, trap 5).
"""
import pytest

from tests.e2e.test_train import TINY, close, losses, train

pytestmark = pytest.mark.e2e


def _scalars(run_dir, suffix):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
            if tag.endswith(suffix)}


def test_replica_slots_and_overlap_same_losses_under_torchrun(tmp_path):
    common = TINY + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=5", "parallel.dp=2",
                     "parallel.ep=2", "log.moe_stats_every=1", "checkpoint.every=0"]
    off, on = tmp_path / "off", tmp_path / "on"
    train(common + [f"run.dir={off}", "moe.replica_slots=0"], tmp_path, nproc=2)
    train(common + [f"run.dir={on}", "moe.replica_slots=1"], tmp_path, nproc=2)
    over = tmp_path / "overlap"
    train(common + [f"run.dir={over}", "moe.replica_slots=1", "moe.a2a_overlap_degree=4"],
          tmp_path, nproc=2)
    ref, got, chunked = losses(off), losses(on), losses(over)
    assert sorted(got) == sorted(ref) == sorted(chunked) == [1, 2, 3, 4, 5]
    for step in ref:
        assert close(got[step], ref[step], 1e-5), (step, got[step], ref[step])
        assert close(chunked[step], got[step], 1e-5), (step, chunked[step], got[step])
    # without replicas there is nothing to compare: only rank_imbalance is logged
    off_after = _scalars(off, "/rank_imbalance")
    assert off_after and not _scalars(off, "/rank_imbalance_unreplicated"), sorted(off_after)
    after = _scalars(on, "/rank_imbalance")
    before = _scalars(on, "/rank_imbalance_unreplicated")
    assert after and len(after) == len(before), sorted(after)
    for tag, values in after.items():
        unrep = before[tag + "_unreplicated"]
        # never worse, and better whenever the unreplicated skew is real
        assert all(a <= b + 1e-9 for a, b in zip(values, unrep)), (tag, values, unrep)
        assert max(values) < max(unrep), (tag, values, unrep)
        # step 1 routes the same weights as the run without replicas: its rows per rank are
        # exactly those (later steps may differ in the last bits of the weights)
        assert off_after[tag][0] == unrep[0], (tag, off_after[tag], unrep)
