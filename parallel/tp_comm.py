"""The autograd collectives of tensor parallelism (parallel/tensor.py, parallel/tensor2d.py).

Each is one collective forward and its adjoint backward, over a group handed in:
  gather(x, g, dim)          all-gather along dim; backward reduce-scatters (each rank's
                             gradient of the gathered tensor is a different partial sum:
                             SUMMA's operand gathers, whose products differ per rank)
  reduce_scatter(x, g, dim)  sum the ranks' x, keep this rank's block of dim; backward
                             all-gathers
  all_reduce(x, g)           sum; backward sums (the ranks used the total differently)
  gather_replicated(x, g, d) all-gather along d for a value every rank then uses the same
                             way (the logits a replicated loss reads); backward keeps this
                             rank's block of the (identical) gradient, no communication
  swap(x, g, a, b)           all-to-all: block r of dim a goes to rank r, the blocks received
                             are concatenated along dim b (a layout change: 1d's sequence ->
                             batch split before MoE layers, the grid's hidden -> batch);
                             backward is swap(g, b, a)
Blocks are in group-rank order. Sizes are equal on every rank (the layout checks shapes
before the first collective), so the tensor forms of gloo/NCCL serve all of them.
"""
import torch
import torch.distributed as dist


def _all_gather(x, group, dim):
    P = dist.get_world_size(group)
    if P == 1:
        return x
    out = x.new_empty((P * x.shape[0],) + tuple(x.shape[1:]))  # rank blocks along dim 0
    dist.all_gather_single(out, x.contiguous(), group=group)
    return torch.cat(out.chunk(P), dim=dim) if dim not in (0, -x.dim()) else out


def _reduce_scatter(x, group, dim):
    P = dist.get_world_size(group)
    if P == 1:
        return x
    parts = torch.cat(x.chunk(P, dim=dim)) if dim not in (0, -x.dim()) else x.contiguous()
    out = x.new_empty((parts.shape[0] // P,) + tuple(parts.shape[1:]))
    dist.reduce_scatter_single(out, parts, group=group)
    return out


def _swap(x, group, split_dim, cat_dim):
    P = dist.get_world_size(group)
    if P == 1:
        return x
    send = torch.stack(x.chunk(P, dim=split_dim)).contiguous()  # block r -> rank r
    recv = torch.empty_like(send)                              # block s <- rank s
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=cat_dim)


def _block(x, group, dim):
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, ctx.dim), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _block(g, ctx.group, ctx.dim), None, None


class _Swap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, split_dim, cat_dim):
        ctx.group, ctx.dims = group, (split_dim, cat_dim)
        return _swap(x, group, split_dim, cat_dim)

    @staticmethod
    def backward(ctx, g):
        split_dim, cat_dim = ctx.dims
        return _swap(g, ctx.group, cat_dim, split_dim), None, None, None


def swap(x, group, split_dim, cat_dim):
    return _Swap.apply(x, group, split_dim, cat_dim)


def gather(x, group, dim):
    return _Gather.apply(x, group, dim)


def reduce_scatter(x, group, dim):
    return _ReduceScatter.apply(x, group, dim)


def all_reduce(x, group):
    return _AllReduce.apply(x, group)


def gather_replicated(x, group, dim):
    return _GatherReplicated.apply(x, group, dim)
