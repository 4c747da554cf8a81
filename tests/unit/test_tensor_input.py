"""The tensor-parallel forward refuses shapes the tp split cannot take, before any collective.

A "fake" process group (torch's in-process test backend: every collective is a no-op) gives
this one process a world of 2, so the tp=2 model can be built and called here; a bad shape
must raise a ValueError naming the size and tp rather than reach a collective.
"""
import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel.mesh import build_meshes
from parallel.plan import ParallelPlan
from parallel.tensor.one_d import apply_tensor_parallel
from tests.unit.test_plan import MODEL, MOE


@pytest.fixture
def tp2_model():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        from models import build_model, init_weights
        plan = ParallelPlan(tp=2).validate(2, MODEL, MOE, 8, 64)
        model = init_weights(build_model(MODEL, MOE, device="meta"), 0, torch.device("cpu"))
        apply_tensor_parallel(model, build_meshes(plan, "cpu"))
        yield model
    finally:
        dist.destroy_process_group()


def test_odd_sequence_length_fails_before_any_collective(tp2_model):
    # (without the check: a shape error here, a size-mismatch abort inside gloo on real ranks)
    with pytest.raises(ValueError, match=r"sequence length 63 is not divisible by tp=2"):
        tp2_model(torch.zeros(4, 63, dtype=torch.long))
    assert tp2_model(torch.zeros(4, 64, dtype=torch.long)).shape == (4, 64, MODEL.vocab_size)


def test_odd_batch_with_moe_layers_fails_before_any_collective(tp2_model):
    with pytest.raises(ValueError, match=r"batch of 3 sequences is not divisible by tp=2"):
        tp2_model(torch.zeros(3, 64, dtype=torch.long))
