"""Point-to-point activation messages between pipeline ranks: a small header (rank of the
tensor, its shape, its dtype) and then the tensor, so the receiver can allocate it. Used by
the V schedules' evaluation walk (runner.py) and PipeDream-2BW (twobw.py)."""
import torch
import torch.distributed as dist

from ..dtensors import local

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def activation_messages(h) -> tuple:
    """(header, tensor) to send for activation h: a small header (its shape and dtype) first,
    which recv_activation reads."""
    h = local(h).contiguous()
    header = torch.tensor([h.dim(), *h.shape, *[0] * (4 - h.dim()), _DTYPES.index(h.dtype)],
                          dtype=torch.long, device=h.device)
    return header, h


def send_activation(h, dst: int, group) -> None:
    for t in activation_messages(h):
        dist.send(t, dst, group=group)


def recv_activation(src: int, device, group):
    header = torch.empty(6, dtype=torch.long, device=device)
    dist.recv(header, src, group=group)
    ndim, *dims = header[:5].tolist()
    h = torch.empty(dims[:ndim], dtype=_DTYPES[int(header[5])], device=device)
    dist.recv(h, src, group=group)
    return h
