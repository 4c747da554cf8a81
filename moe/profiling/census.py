"""Op census: what one forward+backward asks of the device, counted on any device.

A TorchDispatchMode sees every aten op a region runs (autograd's backward included). From
them it counts what decides speed on a GPU, where the host issues kernels ahead of the device:
  ops        aten ops that launch work (views and metadata ops are free and not counted)
  syncs      ops whose result the host must read, so the host waits for the device:
             `_local_scalar_dense` (`.item()`, `int(t)`), `nonzero`, `bincount`, `unique`,
             `masked_select`, indexing with a boolean mask, `repeat_interleave` without
             `output_size`, copies to the CPU from another device, and `Tensor.tolist()` /
             `Tensor.numpy()` (which read memory without dispatching an op: the census
             wraps them while it runs)
  bytes      bytes read and written by the non-GEMM ops (every tensor argument and result)
A GEMM (mm, bmm, addmm, grouped mm, ...) is the work itself: counted as an op, not in bytes.
Host tensors: on a CPU machine every tensor is on the host, so the census tells host data from
device data by where it came from: a tensor made from Python data (`torch.tensor(list)`) is
host data, and so is every result of ops whose tensor arguments are all host data; all other
tensors (inputs, parameters, results of ops on them) are device data. Reading host data is
free; only reads of device data count as syncs.
Use: `with OpCensus() as c: loss = f(); loss.backward()`, then `c.summary(ref_bytes)`.
"""
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["OpCensus", "GEMM_OPS", "SYNC_OPS"]

aten = torch.ops.aten
GEMM_OPS = {"mm", "bmm", "addmm", "addbmm", "baddbmm", "_grouped_mm", "_scaled_mm",
            "_scaled_grouped_mm", "matmul", "linear", "addmv", "mv", "dot",
            "router_logits", "router_logits_backward",  # moe/router_ops.py: GEMMs on a GPU
            "grouped_mm"}  # moe/grouped_mm.py's opaque torch._grouped_mm (compile, fake traces)
SYNC_OPS = {"_local_scalar_dense", "nonzero", "bincount", "_unique", "_unique2",
            "unique_dim", "unique_consecutive", "masked_select"}
# ops that move no data: views, metadata, and allocations of uninitialized memory
FREE_OPS = {"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t",
            "squeeze", "unsqueeze", "select", "slice", "alias", "as_strided", "detach",
            "split", "split_with_sizes", "unbind", "chunk", "narrow", "diagonal", "empty",
            "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
            "_reshape_alias", "view_as", "unflatten", "flatten", "sym_size", "sym_stride",
            "sym_numel", "sym_storage_offset", "is_same_size", "_to_copy_noop",
            "record_stream", "set_", "resize_", "_record_function_enter_new",
            "_record_function_exit", "promote_types",
            "device", "dtype", "layout"}  # prims a fake-tensor trace asks: metadata


HOST_MADE = {"lift_fresh", "lift_fresh_copy"}  # torch.tensor(python data)


def _name(func) -> str:
    return func.overloadpacket.__name__


def _is_sync(name: str, args, kwargs) -> bool:
    if name in SYNC_OPS:
        return True
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and not (len(args) > 2 and args[2] is not None)
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        idx = args[1] if len(args) > 1 else ()
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or ())
    if name in ("_to_copy", "copy_"):
        return _to_host(name, args, kwargs)
    return False


def _to_host(name: str, args, kwargs) -> bool:
    if name == "_to_copy":
        dev = kwargs.get("device")
        return dev is not None and torch.device(dev).type == "cpu" and args[0].device.type != "cpu"
    dst, src = args[0], args[1]
    return isinstance(src, torch.Tensor) and dst.device.type == "cpu" and src.device.type != "cpu"


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class OpCensus(TorchDispatchMode):
    """Counts ops, syncs and non-GEMM bytes of what runs inside it (see the module doc).
    `by_op` (name -> count), `sync_ops` (names in order), `bytes_by_op`."""

    def __init__(self):
        super().__init__()
        self.by_op = collections.Counter()
        self.bytes_by_op = collections.Counter()
        self.sync_ops = []
        self._host = WeakIdKeyDictionary()   # tensors holding host data (see the module doc)
        self._patches = contextlib.ExitStack()

    def is_host(self, t) -> bool:
        return t in self._host

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    @property
    def syncs(self) -> int:
        return len(self.sync_ops)

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        tensors_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = name in HOST_MADE or (tensors_in and all(self.is_host(t) for t in tensors_in))
        if host:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._host[t] = True
        if name in FREE_OPS or name in HOST_MADE:
            return out
        self.by_op[name] += 1
        if not host and _is_sync(name, args, kwargs):
            self.sync_ops.append(name)
        if name not in GEMM_OPS:
            flat_in, _ = tree_flatten((args, kwargs))
            flat_out, _ = tree_flatten(out)
            self.bytes_by_op[name] += _bytes(flat_in) + _bytes(flat_out)
        return out

    def __enter__(self):
        for attr in ("tolist", "numpy"):
            self._patches.enter_context(_host_read_hook(self, attr))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def summary(self, ref_bytes: int) -> dict:
        """The census as a dict: ops, syncs (and which), bytes as a multiple of ref_bytes."""
        return {"ops": self.ops, "syncs": self.syncs, "sync_ops": list(self.sync_ops),
                "bytes_x": round(self.bytes / ref_bytes, 1),
                "top_bytes": [(n, round(b / ref_bytes, 1))
                              for n, b in self.bytes_by_op.most_common(8)]}


@contextlib.contextmanager
def _host_read_hook(census: OpCensus, attr: str):
    """Tensor.<attr> counted as a sync while the census runs (it reads device memory on the
    host without dispatching an op)."""
    original = getattr(torch.Tensor, attr)

    def wrapped(self, *a, **k):
        if not census.is_host(self):
            census.sync_ops.append(attr)
        return original(self, *a, **k)
    setattr(torch.Tensor, attr, wrapped)
    try:
        yield
    finally:
        setattr(torch.Tensor, attr, original)


def layer_census(tokens=1024, d_model=256, d_ff=512, num_experts=16, top_k=2,
                 activation="swiglu", dtype=torch.bfloat16, **layer_kw) -> dict:
    """The census of one forward+backward of a one-process grouped-GEMM MoELayer (after a
    warm-up step), as OpCensus.summary gives it, relative to the input's bytes."""
    from ..layer import MoELayer
    torch.manual_seed(0)
    layer = MoELayer(d_model, d_ff, num_experts, top_k, layer_kw.pop("capacity_factor", None),
                     activation, experts_impl="grouped_mm", **layer_kw).to(dtype)
    x = torch.randn(tokens, d_model, dtype=dtype, requires_grad=True)
    gy = torch.randn(tokens, d_model, dtype=dtype)
    layer(x).backward(gy)
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    with OpCensus() as census:
        layer(x).backward(gy)
    return census.summary(x.numel() * x.element_size())


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="Op census of one MoE layer forward+backward "
                                 "(one process, bf16, grouped GEMM experts)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--activation", default="swiglu")
    ap.add_argument("--capacity-factor", type=float, default=None)
    ap.add_argument("--router", default="token_choice", choices=("token_choice", "expert_choice"))
    ap.add_argument("--gates-in-experts", action="store_true",
                    help="the gates applied inside the experts (moe.gates_in_experts)")
    a = ap.parse_args(argv)
    got = layer_census(a.tokens, a.d_model, a.d_ff, a.experts, a.top_k, a.activation,
                       capacity_factor=a.capacity_factor, router=a.router,
                       gates_in_experts=a.gates_in_experts)
    where = ", gates in the experts" if a.gates_in_experts else ""
    print(f"T={a.tokens} D={a.d_model} F={a.d_ff} E={a.experts} k={a.top_k} {a.activation} bf16{where}: "
          f"{got['ops']} ops, {got['syncs']} host syncs, {got['bytes_x']}x the input's bytes "
          f"outside GEMMs")
    print("most bytes: " + ", ".join(f"{n} {b}x" for n, b in got["top_bytes"][:4]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
