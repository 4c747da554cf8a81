"""parallel/strict_devices.py: a collective handed a tensor off the run's device is named,
with its call site, before it runs (what NCCL would reject and gloo takes); and the pipeline's
loss sum, the host tensor this mode was built for, is made on the stage's device.

One process: torch's "fake" process-group backend (collectives are no-ops that still pass
through the dispatcher, where the mode looks). The expected device is "cuda" or "meta" by
type only, so no GPU is needed to see a CPU tensor refused.
"""
import types

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel.strict_devices import WrongDeviceError, check_devices, strict_collectives


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_host_tensor_in_a_cuda_run_is_named_with_its_call_site(fake_group):
    t = torch.ones(3)
    with strict_collectives("cuda"), pytest.raises(WrongDeviceError) as err:
        dist.all_reduce(t)
    msg = str(err.value)
    assert "c10d.allreduce_ was handed a cpu tensor (3,), the run's device is cuda" in msg, msg
    assert "tests/unit/test_strict_devices.py:" in msg and "in test_a_host_tensor" in msg, msg


def test_every_collective_form_is_checked(fake_group):
    x, out = torch.ones(4, 2), torch.empty(4, 2)
    calls = [lambda: dist.all_to_all_single(out, x, [2, 2], [2, 2]),
             lambda: dist.all_gather_into_tensor(torch.empty(8, 2), x),
             lambda: dist.broadcast(x, 0)]
    for call in calls:
        with strict_collectives("meta"), pytest.raises(WrongDeviceError, match="the run's device is meta"):
            call()
    with strict_collectives("cpu"):  # the right device: they run
        for call in calls:
            call()


def test_check_devices_looks_inside_lists():
    check_devices("op", ([torch.ones(1)], {"x": torch.ones(1)}), torch.device("cpu"))
    with pytest.raises(WrongDeviceError, match=r"op was handed a cpu tensor \(2,\)"):
        check_devices("op", ([torch.ones(1, device="meta"), torch.ones(2)],), torch.device("meta"))


def test_the_pipeline_loss_sum_is_made_on_the_stage_device(monkeypatch):
    """A stage without a loss and without MoE layers (DeepSeek-V3's dense first blocks) sums
    zeros: they must be on the stage's device (was: torch.zeros(()) on the host)."""
    from parallel.pipeline import runner as runner_mod
    stage = torch.nn.Linear(2, 2, device="meta")
    handed = []

    def fake_all_reduce(t, group=None):
        check_devices("all_reduce", (t,), torch.device("meta"))
        handed.append(t.device)
    monkeypatch.setattr(runner_mod.dist, "all_reduce", fake_all_reduce)
    r = runner_mod.PipelineRunner.__new__(runner_mod.PipelineRunner)
    r.plan = types.SimpleNamespace(microbatches=2)
    r.model, r._aux = stage, []
    r.meshes = types.SimpleNamespace(group=lambda name: None)
    r._total_loss([], last=False)
    assert handed == [torch.device("meta")]
