"""tests/gpu: the CUDA tier. Every test here is skipped, with the reason, where
torch.cuda.is_available() is false (CI and the project's CPU machine): a skip is never a
pass. Run it on a GPU machine with `python -m pytest tests/gpu -q -rs`."""
import pytest
import torch

REASON = "no CUDA device: the GPU tier runs only where torch.cuda.is_available()"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=REASON)
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def no_tf32():
    """fp32 matmuls in fp32 (TF32 off) for the test, restored after it: the GPU tier compares
    against CPU references at fp32 bounds."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
