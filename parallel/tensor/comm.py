"""The autograd collectives of tensor parallelism (parallel/tensor/one_d.py, parallel/tensor/grid.py).

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
  split(x, g, dim)           this rank's block of a replicated x (1d's sequence split after
                             the embedding); backward all-gathers
  sum_grad(x, g)             identity; backward sums (a replicated weight each rank applies
                             to its own heads: qk_norm under 1d's head split)
  sum_grad_tail(x, g, n)     identity; backward sums the last n channels' gradient only
                             (MLA's shared rotary key, which each rank's heads read, beside
                             the latent, whose gradient arrives summed already)
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


class _Adjoint(torch.autograd.Function):
    """y = forward(x, group, *dims); dx = backward(dy, group, *dims): one collective each way."""

    @staticmethod
    def forward(ctx, x, forward, backward, group, *dims):
        ctx.backward, ctx.group, ctx.dims = backward, group, dims
        return forward(x, group, *dims)

    @staticmethod
    def backward(ctx, g):
        return (ctx.backward(g, ctx.group, *ctx.dims), None, None, None) + (None,) * len(ctx.dims)


def _all_reduce(x, group):
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def gather(x, group, dim):
    return _Adjoint.apply(x, _all_gather, _reduce_scatter, group, dim)


def reduce_scatter(x, group, dim):
    return _Adjoint.apply(x, _reduce_scatter, _all_gather, group, dim)


def all_reduce(x, group):
    return _Adjoint.apply(x, _all_reduce, _all_reduce, group)


def _identity(x, group, *dims):
    return x


def sum_grad(x, group):
    return _Adjoint.apply(x, _identity, _all_reduce, group)


def _all_reduce_tail(g, group, n):
    g = g.clone()
    tail = g[..., -n:].contiguous()
    dist.all_reduce(tail, group=group)
    g[..., -n:] = tail
    return g


def sum_grad_tail(x, group, n):
    return _Adjoint.apply(x, _identity, _all_reduce_tail, group, n)


def gather_replicated(x, group, dim):
    return _Adjoint.apply(x, _all_gather, _block, group, dim)


def split(x, group, dim):
    return _Adjoint.apply(x, _block, _all_gather, group, dim)


def swap(x, group, split_dim, cat_dim):
    return _Adjoint.apply(x, _swap, _unswap, group, split_dim, cat_dim)


def _unswap(g, group, split_dim, cat_dim):
    return _swap(g, group, cat_dim, split_dim)
