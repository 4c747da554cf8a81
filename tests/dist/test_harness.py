"""The spawn harness itself: results come back, failures and hangs surface quickly."""
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import DistributedTestError, run_distributed

pytestmark = pytest.mark.dist


def _sum_ranks(rank, world, offset):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": float(t) + offset, "threads": torch.get_num_threads(),
            "tensor": torch.full((2,), float(rank))}


def _fail_on_rank1(rank, world):
    if rank == 1:
        raise KeyError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 would wait here until the process-group timeout


def _hang_on_rank0(rank, world):
    if rank == 0:
        time.sleep(60)
    dist.barrier()


def test_results_come_back_per_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the harness's dir goes here
    out = run_distributed(_sum_ranks, 2, 10.0)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["sum"] == 11.0 and o["threads"] == 1 for o in out)
    assert torch.equal(out[1]["tensor"], torch.ones(2))
    assert os.listdir(tmp_path) == []  # rendezvous/result dir removed


def test_first_failure_is_raised_with_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank1, 2, timeout=60)
    assert "rank 1" in str(info.value) and "deliberate failure" in str(info.value)
    assert "_fail_on_rank1" in str(info.value)  # the worker's traceback, not just the type
    assert time.monotonic() - start < 30  # did not wait for the 60 s timeout


def test_hang_hits_the_timeout():
    # the bound is on the hang's handling: start the worker pool first (the forkserver imports
    # torch once; under a loaded CI machine that alone took over 10 s and failed this test)
    assert [o["sum"] for o in run_distributed(_sum_ranks, 2, 0.0)] == [1.0, 1.0]
    start = time.monotonic()
    with pytest.raises(DistributedTestError):
        run_distributed(_hang_on_rank0, 2, timeout=3)
    assert time.monotonic() - start < 15


def test_nested_function_is_rejected_before_spawning():
    def local(rank, world):
        return rank
    with pytest.raises(ValueError, match="module level"):
        run_distributed(local, 2)
