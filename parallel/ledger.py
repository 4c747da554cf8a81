"""Communication ledger: the bytes this rank hands to each collective, by kind, per step.

Counted at the torch.distributed boundary, not by formula: while `recording()` is active, a
TorchDispatchMode sees every c10d op (dist.all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single, broadcast, send/recv: FSDP2's gathers and
reduce-scatters and the pipeline schedules' send/recv included) and every functional
collective (DTensor redistribution under tensor parallelism).

Bytes per call = the input buffer this rank hands over: all_reduce / broadcast / send its
tensors, all_gather its shard, reduce_scatter its full input, all_to_all its whole send
buffer (including rows it keeps), recv nothing. (Wire traffic depends on the algorithm, e.g.
a ring all-reduce sends 2(P-1)/P of that; the payload is what the layout decides.)

Kind, from the op and the process group it runs on (mesh.py dims):
  dp_grad_reduce            all_reduce over dp / pool / edp (gradient sync, ZeRO-1)
  zero_param_gather         all_gather over dp / pool / edp (ZeRO-1/2 slices, FSDP2 params)
  zero_grad_reduce_scatter  reduce_scatter over dp / pool / edp (ZeRO-2, FSDP2)
  expert_all_to_all         all_to_all over ep (token dispatch and combine, count tables)
  expert_tensor_parallel    all_to_all over etp (rows gathered for the d_ff slices, partial
                            outputs returned, count tables: moe/expert_tp.py)
  tensor_parallel           any collective over tp (incl. MoE sequence<->batch all_to_all)
  tensor_parallel_row       tp_mode 2d/2.5d, over a grid column's ranks (tpr): weight
                            gathers and weight-gradient reduce-scatters, norm-weight sums
  tensor_parallel_col       tp_mode 2d/2.5d, over a grid row's ranks (tpc): activation
                            gathers and reduce-scatters, norm statistics, MoE all_to_all
  tensor_parallel_depth     tp_mode 2.5d, over the stacked grids (tpd): weight-gradient sums
  pipeline                  send/recv and reductions over pp
  tied_embedding            the tied weight's gradient sum over the first/last stage pair
  muon_orthogonalise        Muon's pieces of each matrix to its owner rank and the results
                            back (two all_to_alls per group and step: parallel/muon.py)
  other                     everything else: the gradient-norm and overflow all_reduces,
                            expert-load sums (booked explicitly: on a world-sized dp the
                            group alone cannot tell them from gradient sync)
"""
import contextlib
import threading
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("dp_grad_reduce", "zero_param_gather", "zero_grad_reduce_scatter", "expert_all_to_all",
         "expert_tensor_parallel", "tensor_parallel", "tensor_parallel_row", "tensor_parallel_col",
         "tensor_parallel_depth", "pipeline", "tied_embedding", "context_parallel",
         "muon_orthogonalise", "other")
GRID_KINDS = {"tpd": "tensor_parallel_depth", "tpr": "tensor_parallel_row", "tpc": "tensor_parallel_col"}
DATA_DIMS = {"dp", "pool", "edp"}
# op name -> (collective class, index of the argument holding this rank's input)
_OPS = {"allreduce_": ("reduce", 0), "allreduce_coalesced_": ("reduce", 0), "all_reduce": ("reduce", 0),
        "all_reduce_": ("reduce", 0), "all_reduce_coalesced": ("reduce", 0),
        "broadcast_": ("reduce", 0), "broadcast": ("reduce", 0),
        "_allgather_base_": ("gather", 1), "allgather_": ("gather", 1),
        "allgather_into_tensor_coalesced_": ("gather", 1), "all_gather_into_tensor": ("gather", 0),
        "all_gather_into_tensor_coalesced": ("gather", 0),
        "_reduce_scatter_base_": ("scatter", 1), "reduce_scatter_": ("scatter", 1),
        "reduce_scatter_tensor_coalesced_": ("scatter", 1), "reduce_scatter_tensor": ("scatter", 0),
        "reduce_scatter_tensor_coalesced": ("scatter", 0),
        "alltoall_base_": ("a2a", 1), "alltoall_": ("a2a", 1), "all_to_all_single": ("a2a", 0),
        "send": ("p2p", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0)}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_of(args):
    """(group name, ProcessGroup or None) of a collective's arguments."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                pg = dist.ProcessGroup.unbox(a)
                return pg.group_name, pg
            except RuntimeError:
                continue  # a ReduceOp, not a group
    strings = [a for a in args if isinstance(a, str)]
    return (strings[-1] if strings else None), None  # functional collectives pass the name


def _resolve(name: str):
    """The ProcessGroup registered under `name`, or None."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(name)
    except (ValueError, RuntimeError, KeyError):
        return None


def classify(collective: str, dims: set) -> str:
    """The ledger kind of a collective class run on a group that is these mesh dims."""
    if "tied" in dims:
        return "tied_embedding"
    if "cp" in dims:  # the ring's send/recv or Ulysses' all-to-alls (parallel/context/)
        return "context_parallel"
    if collective in ("p2p", "recv") or "pp" in dims:
        return "pipeline"
    for dim, kind in GRID_KINDS.items():  # a grid group may also be an ep/edp/pool group
        if dim in dims:
            return kind
    if collective == "a2a":
        if "etp" in dims:
            return "expert_tensor_parallel"
        return "expert_all_to_all" if "ep" in dims else "tensor_parallel" if "tp" in dims else "other"
    if "tp" in dims and not dims & DATA_DIMS:
        return "tensor_parallel"
    if dims & DATA_DIMS:
        return {"reduce": "dp_grad_reduce", "gather": "zero_param_gather",
                "scatter": "zero_grad_reduce_scatter"}[collective]
    return "tensor_parallel" if "tp" in dims else "other"


class CommLedger:
    """`with ledger.recording(): ...` then `ledger.take()` -> {kind: bytes} since the last take.

    `groups`: {dim name: ProcessGroup} (e.g. every dim of a parallel.mesh.Meshes plus "tied");
    a group serving several dims (ep == tp, or a dp of 1) counts as all of them. A group not
    listed that lies inside a data group (FSDP2's hpZ post-forward shard groups) counts as a
    data group. `ranks_per_node`: global ranks [k*n, (k+1)*n) form node k; the bytes of
    collectives whose group spans several nodes are also counted by kind in `take_inter_node()`
    (None: one node, nothing is inter-node). The all-to-alls are also split by peer:
    `take_a2a_nodes()` gives, per kind, the bytes sent to ranks of this rank's node and to
    other nodes, by dtype (a row's split goes where its peer is; rows kept count as inside).
    """

    def __init__(self, groups: dict, ranks_per_node: int | None = None):
        self.dims_of, self.ranks_of, self.order_of = {}, {}, {}
        for dim, group in groups.items():
            if group is not None:
                self.dims_of.setdefault(group.group_name, set()).add(dim)
                self.ranks_of[group.group_name] = frozenset(dist.get_process_group_ranks(group))
                self.order_of[group.group_name] = list(dist.get_process_group_ranks(group))
        self.ranks_per_node = ranks_per_node
        self.bytes, self.inter, self.calls, self.a2a_nodes = Counter(), Counter(), Counter(), Counter()
        self._labels = threading.local()  # a label is its thread's: under parallel.a2a_overlap
        # the other micro-batch's thread books its own collectives while this one is labelled

    @property
    def label(self):
        return getattr(self._labels, "kind", None)

    @label.setter
    def label(self, kind):
        self._labels.kind = kind

    def _dims(self, name, pg) -> set:
        if name not in self.dims_of and pg is None and name is not None:
            pg = _resolve(name)  # a functional collective names its group
        if name not in self.dims_of and pg is not None:  # a group made outside the meshes
            ranks = frozenset(dist.get_process_group_ranks(pg))
            same = [n for n, r in self.ranks_of.items() if r == ranks and n in self.dims_of]
            self.ranks_of[name] = ranks
            self.order_of[name] = list(dist.get_process_group_ranks(pg))
            # a copy of a mesh group (the overlap's second communicator for the other thread,
            # parallel/interleave.py) serves its dims; a subgroup of a data group is data
            self.dims_of[name] = set(self.dims_of[same[0]]) if same else \
                {d for n, r in self.ranks_of.items() if ranks <= r
                 for d in self.dims_of.get(n, ()) if d in DATA_DIMS}
        return self.dims_of.get(name, set())

    def _spans_nodes(self, name) -> bool:
        ranks = self.ranks_of.get(name)
        return bool(self.ranks_per_node and ranks) and \
            len({r // self.ranks_per_node for r in ranks}) > 1

    def record(self, op_name: str, args, functional: bool = False) -> None:
        collective, arg = _OPS.get(op_name, (None, 0))
        if collective is None:
            return
        size = 0 if collective == "recv" else _nbytes(args[arg])
        name, pg = _group_of(args)
        dims = self._dims(name, pg)
        if functional and dims & {"tp", *GRID_KINDS}:  # DTensor redistribution: tensor
            dims = dims & {"tp", *GRID_KINDS}           # parallelism's (a tp group may also be
                                                        # the pool/edp group)
        kind = self.label or classify(collective, dims)
        self.bytes[kind] += size
        self.calls[kind, collective, len(self.ranks_of.get(name, ()))] += size
        if self._spans_nodes(name):
            self.inter[kind] += size
        if collective == "a2a":
            self._split_a2a(kind, name, args, functional)

    def _split_a2a(self, kind, name, args, functional) -> None:
        """Book an all_to_all_single's send buffer by where each peer's rows go."""
        x = args[0] if functional else args[1]
        splits = list(args[2] if functional else args[4])
        peers = self.order_of.get(name)
        if peers is None or not isinstance(x, torch.Tensor):
            return
        if not splits:
            splits = [x.shape[0] // len(peers)] * len(peers) if x.dim() else [0] * len(peers)
        row = x[0].numel() * x.element_size() if x.dim() and x.shape[0] else 0
        me, n = dist.get_rank(), self.ranks_per_node
        dtype = str(x.dtype).removeprefix("torch.")
        for peer, rows in zip(peers, splits):
            where = "inter_node" if n and peer // n != me // n else "intra_node"
            self.a2a_nodes[kind, where, dtype] += int(rows) * row
    @contextlib.contextmanager
    def labelled(self, kind: str):
        """Book the collectives inside under `kind` (e.g. "other" for a scalar norm reduction
        that runs on a group which is also the dp group)."""
        assert kind in KINDS, kind
        outer, self.label = self.label, kind
        try:
            yield
        finally:
            self.label = outer  # nested labels (clip inside the step's "other") restore it

    @contextlib.contextmanager
    def recording(self):
        with _Tap(self):
            yield self

    def take(self) -> dict:
        out = {k: int(self.bytes[k]) for k in KINDS if self.bytes[k]}
        self.bytes.clear()
        return out

    def take_calls(self) -> dict:
        """{(kind, collective class, group size): bytes} since the last call: what turns a
        payload into wire bytes (planner/step_time.py's ring factors)."""
        out = dict(self.calls)
        self.calls.clear()
        return out

    @property
    def multi_node(self) -> bool:
        return self.ranks_per_node is not None and self.ranks_per_node < dist.get_world_size()

    def take_a2a_nodes(self) -> dict:
        """{kind: {"intra_node" | "inter_node": {dtype: bytes}}} of the all-to-alls since the
        last call (e.g. expert_all_to_all's rows inside and across nodes, by wire dtype)."""
        out = {}
        for (kind, where, dtype), n in sorted(self.a2a_nodes.items()):
            out.setdefault(kind, {}).setdefault(where, {})[dtype] = int(n)
        self.a2a_nodes.clear()
        return out

    def take_inter_node(self) -> dict:
        """{kind: bytes} of the collectives since the last call whose group spans nodes."""
        out = {k: int(self.inter[k]) for k in KINDS if self.inter[k]}
        self.inter.clear()
        return out


class _Tap(TorchDispatchMode):
    def __init__(self, ledger: CommLedger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            self.ledger.record(func._opname, args, func.namespace == "_c10d_functional")
        return func(*args, **(kwargs or {}))


def mesh_groups(meshes, extra: dict = None) -> dict:
    """{dim: group} for CommLedger from a parallel.mesh.Meshes (plus e.g. {"tied": group})."""
    dims = ("pp", "dp", "tp", "edp", "ep", "etp", "pool")
    if meshes.grid is not None:
        dims += tuple(GRID_KINDS)
    if meshes.cp_group is not None:
        dims += ("cp",)
    groups = {dim: meshes.group(dim) for dim in dims}
    return {**groups, **(extra or {})}
