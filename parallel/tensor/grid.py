"""2-D (Optimus: Xu and You, IPDPS 2023) and 2.5-D (Tesseract: Wang et al., ICPP 2022) tensor
parallelism for the GPT of models/: parallel.tp_mode = "2d" | "2.5d".

Grid legend: tp = d*q*q ranks; tp rank t sits at (k, i, j) = (t // (q*q), (t // q) % q, t % q)
of the mesh dims ("tpd", "tpr", "tpc") (parallel/mesh.py):
  k  depth: which of the d stacked q x q grids (d = parallel.tp_depth; 1 under 2d)
  i  grid row: with k, which block of the batch this rank's activations hold
  j  grid column: which block of the hidden dim (and of the heads, d_ff and vocab)
Shapes: B batch of one dp rank, b = B/(d*q) sequences of one grid row, S sequence, D model
dim, Dq = D/q, F ffn dim, Fq = F/q, V vocab, Vq = V/q.

Activations between modules are [b, S, Dq] on rank (k, i, j): sequences of block k*q+i, hidden
block j. Weights (nn.Linear's [out, in] layout, the banks' [1, in, out]) are DTensors split
over tpr and tpc and replicated over tpd, so checkpoints hold the whole matrix and reshard
to any layout. Y = X W is SUMMA (the all-gather forms of its operand broadcasts), two ways:
  gather form   (q/k/v, w1/w3, lm_head; W block (in i, out j) on rank (*, i, j)): X gathered
                over tpc to [b, S, in], W over tpr to [out/q, in]; x @ w.T is rows (k, i) x
                out block j, the input's own layout
  scatter form  (o, w2: their input is already split over tpc, by heads / by d_ff; W block
                (out i, in j)): W gathered over tpr to [out, in/q]; the q partial products
                [b, S, out] reduce-scattered over tpc to out block j
The backward is the adjoint: a gather's is a reduce-scatter and vice versa, so dW is the
q row blocks' partial products summed over tpr and, under 2.5d, over tpd (a Partial
gradient placement that the gradient sync settles, like 1d's sequence-parallel norms).

  tok_emb  [V, D] placed like lm_head (vocab over tpc, D over tpr), one matrix when tied:
           gathered over tpr to [Vq, D]; this row's sequences looked up in vocab block j
           (zeros elsewhere) give [b, S, D] partial over the vocab blocks; reduce-scattered
           over tpc along D to [b, S, Dq]
  pos_emb  [Smax, D], D over tpc
  norms    statistics over D: local sums all-reduced over tpc; weight split over tpc
  attention one gather of x over tpc feeds q, k and v (heads split over tpc, whole sequences
           per rank: attention itself is local); o in the scatter form
  dense FFN w1/w3 [1, D, F] gather form, w2 [1, F, D] scatter form on the hidden [b, S, Fq]
  shared experts (MoE layers' always-on FFN) as the dense FFN, on [b, S, Dq] before the
           all-to-all below, their output added after the inverse one
  MoE FFN  the layout changes here: [b, S, Dq] -> [b/q, S, D] by one all-to-all over tpc, so
           each tp rank holds B/tp whole sequences with the whole hidden dim, as under 1d
           (routing groups stay whole, every token is routed once, ep/etp apply as usual);
           the inverse all-to-all after combine; the aux loss becomes the tp-mean
  lm_head  logits [b, S, Vq] gathered to [B, S, V] on every tp rank so any loss function
           works (its backward keeps each rank's block: no communication)
The module classes are grafted in place (a subclass adding the grid forward, as FSDP2's
fully_shard does), so parameter names, reset_parameters and init streams stay the model's.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from models.blocks import blocks
from moe import DenseFFN, MoELayer

from . import comm as gc
from .one_d import moe_layout_hooks


@dataclass(frozen=True)
class Grid:
    """This rank's place in the grid and the groups along its three dims."""
    mesh: object   # DeviceMesh ("tpd", "tpr", "tpc")
    tpd: object
    tpr: object
    tpc: object
    k: int
    i: int
    j: int
    d: int
    q: int

    @property
    def row_block(self) -> int:
        """Index of this rank's batch block among the d*q grid rows."""
        return self.k * self.q + self.i


def make_grid(meshes) -> Grid:
    mesh = meshes.grid["tpd", "tpr", "tpc"]
    groups = [mesh.get_group(n) for n in ("tpd", "tpr", "tpc")]
    k, i, j = (dist.get_rank(g) for g in groups)
    return Grid(mesh, *groups, k, i, j, dist.get_world_size(groups[0]), dist.get_world_size(groups[2]))


def _place(p: nn.Parameter, grid: Grid, placements) -> nn.Parameter:
    """The full parameter as a DTensor on the grid (each rank slices its own block: every rank
    built the same weights, or is on meta)."""
    return nn.Parameter(distribute_tensor(p.data, grid.mesh, placements, src_data_rank=None),
                        requires_grad=p.requires_grad)


def _matrix(row_dim: int, col_dim: int) -> list:
    """Placements of a matrix split over the grid: dim row_dim over tpr, col_dim over tpc."""
    return [Replicate(), Shard(row_dim), Shard(col_dim)]


def _local(p):
    """p's block, whose gradient is Partial over the dims p is replicated on (those ranks saw
    other sequences) and complete over the dims it is split on."""
    grad = [Partial() if isinstance(pl, Replicate) and n > 1 else pl
            for pl, n in zip(p.placements, p.device_mesh.shape)]
    return p.to_local(grad_placements=grad)


def _gathered_weight(p, grid: Grid, in_dim: int):
    """Block (all in, out j) of a matrix: its local block gathered over tpr along `in_dim`."""
    return gc.gather(_local(p), grid.tpr, in_dim)


class _GridLinear:
    """y [b, S, out/q] = x @ W[:, block j]; x arrives [b, S, in/q] (gathered here over tpc) or,
    with gathered_input, already [b, S, in] (attention's q/k/v share one gather)."""

    def forward(self, x):
        if not self.gathered_input:
            x = gc.gather(x, self.grid.tpc, -1)
        return F.linear(x, _gathered_weight(self.weight, self.grid, 1))


class _GridRowLinear:
    """The reduce-scatter form, for a matmul whose input is already split over tpc (the
    attention output by heads, the FFN hidden by d_ff): the weight is placed (out over tpr,
    in over tpc); each rank multiplies its [b, S, in/q] by the gathered [out, in/q] block
    and the q partial outputs are reduce-scattered over tpc to [b, S, out/q]. Moves T out
    (forward) and T out/q (backward) instead of gathering T in: 4x less for the FFN's w2,
    and the un-gathered input is what backward keeps."""

    def forward(self, x):
        return gc.reduce_scatter(F.linear(x, gc.gather(_local(self.weight), self.grid.tpr, 0)),
                                 self.grid.tpc, -1)


class _GridNorm:
    """RMSNorm / LayerNorm over a hidden dim split over tpc: sums all-reduced over the columns."""

    def forward(self, x):
        g, dtype = self.grid, x.dtype
        x = x.float()
        D = x.shape[-1] * g.q
        eps = self.eps if self.eps is not None else torch.finfo(dtype).eps
        if isinstance(self, nn.LayerNorm):
            x = x - gc.all_reduce(x.sum(-1, keepdim=True), g.tpc) / D
        var = gc.all_reduce(x.pow(2).sum(-1, keepdim=True), g.tpc) / D
        y = x * torch.rsqrt(var + eps)
        if self.weight is not None:
            y = y * _local(self.weight).float()
        if getattr(self, "bias", None) is not None:
            y = y + _local(self.bias).float()
        return y.to(dtype)


class _GridTokenEmbedding:
    """ids [B, S] (the dp rank's whole batch, same on every tp rank) -> [b, S, Dq]."""

    def forward(self, ids_BS):
        g = self.grid
        ids_bS = ids_BS.chunk(g.d * g.q)[g.row_block]
        w_VqD = _gathered_weight(self.weight, g, 1)
        Vq = w_VqD.shape[0]
        rel_bS = ids_bS - g.j * Vq
        inside_bS = (rel_bS >= 0) & (rel_bS < Vq)
        e_bSD = F.embedding(torch.where(inside_bS, rel_bS, 0), w_VqD) * inside_bS.unsqueeze(-1)
        return gc.reduce_scatter(e_bSD, g.tpc, -1)


class _GridColumnEmbedding:
    """positions [S] -> [S, Dq]: the table's hidden dim is split over tpc."""

    def forward(self, pos_S):
        return F.embedding(pos_S, _local(self.weight))


class _GridFFN:
    """The dense FFN on [b, S, Dq]: act(x @ w1 (, x @ w3)) gathered over tpc, then @ w2."""

    def forward(self, x_bSD):
        g, bank = self.grid, self.bank
        x = gc.gather(x_bSD, g.tpc, -1)
        h1 = x @ _gathered_weight(bank.w1, g, 1)[0]
        h3 = x @ _gathered_weight(bank.w3, g, 1)[0] if bank.w3 is not None else None
        a = bank.act(h1, h3)                                      # [b, S, Fq]: block j
        return gc.reduce_scatter(a @ gc.gather(_local(bank.w2), g.tpr, 2)[0], g.tpc, -1)


def _graft(module: nn.Module, mixin: type, grid: Grid, **attrs) -> None:
    """Give `module` the grid forward of `mixin` (a subclass of its own class, made here)."""
    cls = type(module)
    module.__class__ = type(f"Grid{cls.__name__}", (mixin, cls), {})
    module.grid = grid
    for k, v in attrs.items():
        setattr(module, k, v)


def _linear(lin: nn.Linear, grid: Grid, gathered_input: bool = False) -> None:
    if lin.bias is not None:
        raise NotImplementedError("tp_mode 2d/2.5d with biased projections: set model.bias=false")
    lin.weight = _place(lin.weight, grid, _matrix(1, 0))
    _graft(lin, _GridLinear, grid, gathered_input=gathered_input)


def _row_linear(lin: nn.Linear, grid: Grid) -> None:
    if lin.bias is not None:
        raise NotImplementedError("tp_mode 2d/2.5d with biased projections: set model.bias=false")
    lin.weight = _place(lin.weight, grid, _matrix(0, 1))
    _graft(lin, _GridRowLinear, grid)


def _norm(norm: nn.Module, grid: Grid) -> None:
    for name in ("weight", "bias"):
        p = getattr(norm, name, None)
        if p is not None:
            setattr(norm, name, _place(p, grid, [Replicate(), Replicate(), Shard(0)]))
    _graft(norm, _GridNorm, grid)


def _ffn(ffn: DenseFFN, grid: Grid) -> None:
    bank = ffn.bank
    if ffn.gate is not None or bank.b1 is not None:
        raise NotImplementedError("tp_mode 2d/2.5d with a gated or biased dense FFN is not "
                                  "implemented; set model.bias=false")
    for name, (row, col) in (("w1", (1, 2)), ("w3", (1, 2)), ("w2", (2, 1))):
        p = getattr(bank, name)
        if p is not None:  # w2 in the reduce-scatter form: D over tpr, d_ff over tpc
            setattr(bank, name, _place(p, grid, _matrix(row, col)))
    _graft(ffn, _GridFFN, grid)


def _shared_on_grid(layer: MoELayer, grid: Grid) -> None:
    """The shared experts are a dense FFN every token goes through: split over the grid like
    the dense FFN and run on the grid layout [b, S, Dq] before the MoE layer's all-to-all;
    their output is added to the routed experts' after the inverse all-to-all: registered
    after moe_layout_hooks, the pre-hook goes first (prepend) and the forward hook last."""
    _ffn(layer.shared_experts, grid)
    layer.set_shared_run_outside()
    held = {}

    def pre(mod, args):
        held["y"] = mod.shared_experts(args[0])

    def post(_mod, _args, out):
        return out + held.pop("y")

    layer.register_forward_pre_hook(pre, prepend=True)
    layer.register_forward_hook(post)


def _gather_attention_input(grid: Grid):
    def pre(_mod, args):
        return (gc.gather(args[0], grid.tpc, -1),) + tuple(args[1:])
    return pre


def _full_logits(grid: Grid):
    """[b, S, Vq] -> [B, S, V]: vocab blocks over tpc, then the batch blocks over tpr and tpd."""
    def post(_mod, _args, out):
        out = gc.gather_replicated(out, grid.tpc, -1)
        return gc.gather_replicated(gc.gather_replicated(out, grid.tpr, 0), grid.tpd, 0)
    return post


def _check_input(model, grid: Grid, tp_group) -> None:
    """Fail on a batch the grid cannot split before the embedding's first collective."""
    rows, tp = grid.d * grid.q, grid.d * grid.q * grid.q
    has_moe = any(isinstance(m, MoELayer) for m in model.modules())

    def pre(_mod, args):
        B = args[0].shape[0]
        need = tp if has_moe else rows
        if B % need:
            why = ("MoE layers give each tp rank whole sequences" if has_moe
                   else f"the grid splits the batch over its {rows} rows")
            raise ValueError(f"tensor parallelism (tp_mode 2d/2.5d): batch of {B} sequences is not "
                             f"divisible by {need} ({why}); use a batch of a multiple of {need} "
                             f"sequences (train.py: train.batch_size, parallel.microbatches)")
    model.tok_emb.register_forward_pre_hook(pre, prepend=True)


def apply_grid_tensor_parallel(model: nn.Module, meshes) -> None:
    """Shard the GPT (or the pipeline stage of it) over the 2-D / 2.5-D grid, in place."""
    grid = make_grid(meshes)
    tied = model.lm_head is not None and model.tok_emb is not None and \
        model.lm_head.weight is model.tok_emb.weight
    if model.tok_emb is not None:
        model.tok_emb.weight = _place(model.tok_emb.weight, grid, _matrix(1, 0))
        _graft(model.tok_emb, _GridTokenEmbedding, grid)
        _check_input(model, grid, meshes.group("tp"))
    if getattr(model, "pos_emb", None) is not None:
        model.pos_emb.weight = _place(model.pos_emb.weight, grid, [Replicate(), Replicate(), Shard(1)])
        _graft(model.pos_emb, _GridColumnEmbedding, grid)
    for block in blocks(model):
        _shard_block(block, grid, meshes.group("tp"))
    if model.norm is not None:
        _norm(model.norm, grid)
    if model.lm_head is not None:
        if tied:  # the embedding's DTensor, same placements: one parameter again
            model.lm_head.weight = model.tok_emb.weight
            _graft(model.lm_head, _GridLinear, grid, gathered_input=False)
        else:
            _linear(model.lm_head, grid)
        model.lm_head.register_forward_hook(_full_logits(grid))


def _shard_block(block, grid: Grid, tp_group) -> None:
    _norm(block.attn_norm, grid)
    _norm(block.ffn_norm, grid)
    attn = block.attn
    for name in ("wq", "wk", "wv"):
        _linear(getattr(attn, name), grid, gathered_input=True)
    _row_linear(attn.wo, grid)
    attn.register_forward_pre_hook(_gather_attention_input(grid))
    if isinstance(block.ffn, MoELayer):
        moe_layout_hooks(block.ffn, grid.tpc, tp_group, split_dim=0, cat_dim=2)
        if block.ffn.shared_experts is not None:
            _shared_on_grid(block.ffn, grid)
    elif isinstance(block.ffn, DenseFFN):
        _ffn(block.ffn, grid)
    else:
        raise TypeError(f"tensor parallelism does not know FFN type {type(block.ffn).__name__}")
