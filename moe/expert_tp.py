"""Expert tensor parallelism: every expert's d_ff split over the n ranks of a group.

Shapes: N rows dispatched to this rank, M rows gathered over the group, D model dim, F the
expert's full ffn dim (F/n held here), W expert slots on this rank, n ranks of the group.

The ranks of an expert-tensor-parallel (etp) group hold the same experts (the same
expert-parallel coordinate), rank j the j-th block of F: columns [j*F/n, (j+1)*F/n) of w1 and
w3 (and b1, b3), the same rows of w2. Each rank's tokens reach its experts as without etp
(locally, or by the expert-parallel all-to-all); then, where the layout changes:
  1. gather: every rank sends its N rows to every rank of the group (one all_to_all), so each
     holds the M rows of the whole group, re-sorted (slot, source rank) so each expert's rows
     are contiguous;
  2. each rank runs its F/n slice of every expert on all M rows: partial outputs [M, D]
     (the activation is elementwise over F, so the slice of the hidden layer is exact);
  3. scatter-reduce: each partial goes back to the rank the row came from (one all_to_all)
     and the n partials of a row are summed there, in rank order.
The backward of 3 sends the output gradient to every slice, that of 1 sums the n input
gradients of a row: every weight slice gets its gradient from the whole group's tokens,
like an expert-parallel expert from the ep group's. The only distributed calls are those of
moe/all_to_all.py. b2 (added once per row, not per slice) is not split: layers with expert
biases are refused (check_ffn_shardable).
"""
import torch
import torch.distributed as dist

from .all_to_all import all_to_all, exchange_counts
from .ep_dispatcher import source_to_expert_order

# the d_ff dim of each ExpertBank parameter that is split (b2 has none)
FFN_DIMS = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1}


def ffn_block(t: torch.Tensor, name: str, rank: int, n: int) -> torch.Tensor:
    """Rank `rank` of n's block of expert parameter `name` (full d_ff) along its d_ff dim."""
    d = FFN_DIMS[name]
    size = t.shape[d] // n
    return t.narrow(d, rank * size, size)


def check_ffn_shardable(layer, group) -> tuple:
    """(n, j) of `group` if `layer`'s experts can be split over it; else one clear error,
    before any collective."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert tensor parallelism needs torch.distributed initialized")
    n, j = dist.get_world_size(group), dist.get_rank(group)
    if j < 0:
        raise ValueError(f"this rank (global {dist.get_rank()}) is not a member of the expert "
                         f"tensor-parallel group; every rank must pass the group that contains it")
    if layer.etp_group is not None:
        raise ValueError("this MoELayer's experts are already split over an etp group; split once")
    F = layer.experts.w1.shape[-1]
    if F != layer.d_ff:
        raise ValueError(f"layer.experts holds d_ff={F} of {layer.d_ff}: split a layer that "
                         f"still has its full expert weights")
    if F % n:
        raise ValueError(f"the experts' d_ff={F} (moe.d_ff, else model.d_ff) is not divisible by "
                         f"parallel.etp={n}; pick an etp that divides it")
    if layer.experts.b2 is not None:
        raise ValueError(f"parallel.etp={n} with expert biases (model.bias=true): the output bias "
                         f"is added once per row, not per d_ff slice; set model.bias=false or "
                         f"parallel.etp=1")
    if layer.replica_slots:
        raise ValueError(f"moe.replica_slots={layer.replica_slots} with parallel.etp={n}: replica "
                         f"placement is decided per expert-parallel group and would differ between "
                         f"the ranks that split an expert; set moe.replica_slots=0 or parallel.etp=1")
    return n, j


def split_layer_ffn(layer, group) -> None:
    """Keep this rank's d_ff block of every expert of `layer` (in place: the Parameter objects
    stay the same, so build optimizers afterwards) and run the experts over `group`."""
    n, j = check_ffn_shardable(layer, group)
    for name, p in layer.experts.named_parameters(recurse=False):
        if name in FFN_DIMS:
            p.data = ffn_block(p.data, name, j, n).clone()
            p.grad = None
    layer.etp_group = group


def tensor_parallel_experts(experts, x_ND: torch.Tensor, counts_W, extend, group,
                            gate_N=None) -> torch.Tensor:
    """experts(x_ND, counts_W, extend) with each expert's d_ff split over `group` (see the
    module docstring): gather the group's rows, run this rank's slice, sum the slices' partial
    outputs on the rows' own ranks. Every rank of the group must call it (collective).
    gate_N: each row's routing gate (moe.gates_in_experts), gathered beside the rows (each
    slice's gate gradient is its part of <dy W2^T, a>: the gather's backward sums them)."""
    n, N, D = dist.get_world_size(group), x_ND.shape[0], x_ND.shape[-1]
    counts_W = torch.as_tensor(counts_W, dtype=torch.long, device=x_ND.device)
    counts_nW = exchange_counts(counts_W.expand(n, -1), group)  # row j: rank j's counts
    rows_n = counts_nW.sum(1).tolist()
    x_MD = all_to_all(x_ND.expand(n, N, D).reshape(n * N, D), rows_n, [N] * n, group)
    perm_M = source_to_expert_order(counts_nW)  # (rank, slot) order -> (slot, rank) order
    g_M = None
    if gate_N is not None:
        g_M = all_to_all(gate_N.view(1, N, 1).expand(n, N, 1).reshape(n * N, 1), rows_n, [N] * n,
                         group).view(-1)[perm_M]
    y_MD = experts(x_MD[perm_M], counts_nW.sum(0).tolist(), extend, gate_N=g_M)
    unperm_M = torch.empty_like(perm_M)
    unperm_M[perm_M] = torch.arange(perm_M.numel(), device=perm_M.device)
    partial_nND = all_to_all(y_MD[unperm_M], [N] * n, rows_n, group).reshape(n, N, -1)
    return partial_nND.sum(0)
