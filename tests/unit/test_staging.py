"""parallel/staging.py, the host copy an async checkpoint writes from: each tensor (and each
DTensor's local part) copied once, a copy that later in-place changes do not reach, the
buffers' reuse, and the DCP stager protocol on the CPU (the copies are made at once, so no
Future and nothing to fence). The CUDA side (pinned buffers, a side stream, the fence) is in
tests/gpu/test_train_cuda.py."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.staging import HostStager


class _CopiedBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("_to_copy", "copy_", "clone"):
            self.bytes += out.numel() * out.element_size()
        return out


@pytest.fixture
def mesh():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_each_tensor_is_copied_once_and_kept_apart(mesh):
    local = torch.arange(12.0).reshape(3, 4)
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    plain = torch.ones(5)
    state = {"model": {"w": dt, "b": plain}, "optim": {"param_groups": [{"lr": 0.1}], "step": 3}}
    stager = HostStager()
    with _CopiedBytes() as copied:
        out = stager.stage(state)
    assert copied.bytes == local.numel() * 4 + plain.numel() * 4  # the DTensor's local once
    w = out["model"]["w"]
    assert isinstance(w, DTensor) and w.placements == (Shard(0),) and w.shape == dt.shape
    assert torch.equal(w.to_local(), local) and w.to_local().data_ptr() != local.data_ptr()
    local.add_(100)   # the optimizer's next step
    plain.zero_()
    assert torch.equal(w.to_local(), torch.arange(12.0).reshape(3, 4))
    assert torch.equal(out["model"]["b"], torch.ones(5))
    assert out["optim"] == {"param_groups": [{"lr": 0.1}], "step": 3}
    stager.fence()                # nothing in flight on the CPU
    stager.synchronize_staging()
    assert stager.copied is None and not stager.buffers


def test_a_replicated_dtensor_keeps_its_spec(mesh):
    dt = DTensor.from_local(torch.randn(4), mesh, [Replicate()], run_check=False)
    out = HostStager().stage({"x": dt})["x"]
    assert out.placements == (Replicate(),) and out.device_mesh == mesh
    assert torch.equal(out.to_local(), dt.to_local())
