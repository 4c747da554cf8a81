"""The tensor-parallel forward refuses shapes the tp split cannot take, before any collective.

A "fake" process group (torch's in-process test backend: every collective is a no-op) gives
this one process a world of 2, so the tp=2 model can be built and called here; a bad shape
must raise a ValueError naming the size and tp rather than reach a collective.
"""
import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from models.config import MoEConfig
from parallel.mesh import build_meshes
from parallel.plan import ParallelPlan
from parallel.tensor.one_d import apply_tensor_parallel
from tests.unit.test_plan import MODEL, MOE


def _tp2_model(moe_cfg):
    from models import build_model, init_weights
    plan = ParallelPlan(tp=2).validate(2, MODEL, moe_cfg, 8, 64)
    model = init_weights(build_model(MODEL, moe_cfg, device="meta"), 0, torch.device("cpu"))
    apply_tensor_parallel(model, build_meshes(plan, "cpu"))
    return model


@pytest.fixture
def fake_world2():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_odd_sequence_length_fails_before_any_collective(fake_world2):
    # (without the check: a shape error here, a size-mismatch abort inside gloo on real ranks)
    model = _tp2_model(MOE)
    with pytest.raises(ValueError, match=r"sequence length 63 is not divisible by tp=2"):
        model(torch.zeros(4, 63, dtype=torch.long))
    assert model(torch.zeros(4, 64, dtype=torch.long)).shape == (4, 64, MODEL.vocab_size)


def test_odd_batch_fails_only_where_moe_layers_route_whole_sequences(fake_world2):
    # dropless token choice routes the sequence split as it is: any batch, one sequence too
    assert _tp2_model(MOE)(torch.zeros(3, 64, dtype=torch.long)).shape == (3, 64, MODEL.vocab_size)
    capped = MoEConfig(**{**MOE.__dict__, "capacity_factor": 1.25, "eval_capacity_factor": "same"})
    with pytest.raises(ValueError, match=r"batch of 3 sequences is not divisible by tp=2 \(MoE "
                                         r"layers with a capacity or expert choice"):
        _tp2_model(capped)(torch.zeros(3, 64, dtype=torch.long))
