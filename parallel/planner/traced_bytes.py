"""The memory-bound bytes of a training step, counted by running the step on fake tensors.

Everything in a step that is not a GEMM is bound by memory bandwidth on a GPU: norms,
activations, rotary embeddings, residual adds, the router's scores and statistics, the
permutation of rows to experts and back, casts, the loss, gradient accumulation, the
gradient norm and the optimizer step. The planner prices them at their bytes over the HBM
bandwidth (step_time.py). Their bytes are counted here the way the op census counts a real
step (moe/profiling/census.py: every tensor a non-GEMM aten op reads and writes): the
single-device model runs one micro-batch forward and backward under FakeTensorMode (shapes
and dtypes, no memory, no arithmetic) inside an OpCensus, in the plan's precision as the run
applies it (parallel/precision.py), with the grouped-GEMM experts a GPU takes. So the count follows the code: a new
op in a block is counted the day it is written, with no formula to keep beside it.

Traces of one and two sequences split each unit's bytes into a part per token and a part per
micro-batch (weights: casts, first gradients), and a third, of one sequence with the expert
banks' bf16 weights already cast, the part once per step (later micro-batches reuse that
cast; under ZeRO-3 each micro-batch casts what FSDP2 gathered). The units are the blocks (forward
hooks, and gradient hooks on their outputs for the backward) and the ends (embedding, final
norm, head, loss, the aux-loss sum). The optimizer step and the gradient norm are traced on
one parameter and counted per stepped byte. For a rank of a layout (rank_bytes):
  blocks    its blocks' per-token bytes x its tokens per micro-batch (the micro-batch's
            sequences x S / (tp x cp): heads, FFN columns and the sequence split) plus their
            per-micro-batch part x its share of the parameters, per micro-batch
  ends      on the pipeline's last stage (the head and loss dominate them)
  gradient accumulation: micro-batches after the first add into the gradients (3 x their bytes)
  norm and optimizer step: per stepped byte (its ZeRO slices / FSDP2 shards, else its params)
Dropless routing is assumed balanced (shapes do not depend on it); the expert part is not
stretched by an imbalance. Eager's ops are counted: parallel.compile fuses some of them.
Shapes: S tokens per sequence, T tokens.
"""
import warnings
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from models.blocks import block_stacks, blocks
from models.cross_entropy import chunked_cross_entropy
from moe import MoELayer
from moe.aux import collect_aux_loss
from moe.experts import ExpertBank
from moe.profiling.census import OpCensus

from ..precision import DTYPES, apply_precision
from .gpu_kernels import gpu_kernels

ENDS = "ends"


@dataclass(frozen=True)
class UnitBytes:
    per_token: float = 0.0   # bytes per token of a micro-batch
    per_micro: float = 0.0   # bytes per micro-batch, independent of its size (weights)
    per_step: float = 0.0    # bytes once per step: the expert banks' weight casts, which later
                             # micro-batches reuse (moe/experts.py; ZeRO-3 casts per micro-batch)


@dataclass
class StepBytes:
    """What a step's memory-bound bytes scale with, for one workload and precision."""
    units: dict = field(default_factory=dict)   # (stack, block index) or ENDS -> UnitBytes
    param_bytes: int = 0                        # the whole model's parameter bytes
    optimizer_per_byte: float = 0.0             # optimizer step bytes per stepped parameter byte
    norm_per_byte: float = 0.0                  # gradient norm + clip bytes per gradient byte


class _Attribution:
    """Which unit the ops running now belong to: forward by the blocks' hooks, backward by
    gradient hooks on each block's output (its backward starts when that gradient is
    complete) and on the first block's input (the embedding's backward)."""

    def __init__(self, model):
        self.unit, self.handles = ENDS, []
        stack = blocks(model)
        for i, b in enumerate(stack):
            self.handles.append(b.register_forward_pre_hook(self._enter(i, first=i == 0)))
            self.handles.append(b.register_forward_hook(self._leave(i)))

    def _set(self, unit):
        def hook(grad):
            self.unit = unit
        return hook

    def _enter(self, i, first):
        def pre(_mod, args):
            self.unit = i
            x = args[0] if args else None
            if first and isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(self._set(ENDS))
        return pre

    def _leave(self, i):
        def post(_mod, _args, out):
            self.unit = ENDS
            y = out[0] if isinstance(out, tuple) else out
            if isinstance(y, torch.Tensor) and y.requires_grad:
                y.register_hook(self._set(i))
        return post

    def close(self):
        for h in self.handles:
            h.remove()


class _UnitCensus(OpCensus):
    """An OpCensus that files each op's bytes under the unit running it."""

    def __init__(self, where: _Attribution):
        super().__init__()
        self.where, self.by_unit = where, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.bytes
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.by_unit[self.where.unit] = self.by_unit.get(self.where.unit, 0) + self.bytes - before
        return out


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


def _forward_backward(model, w, seqs: int) -> None:
    """One micro-batch of `seqs` sequences: forward, task loss + aux loss, backward."""
    V = w.model_cfg.vocab_size
    S = w.stream_tokens.get("decoder")
    if "encoder" in w.stream_tokens:
        src = torch.zeros(seqs, w.stream_tokens["encoder"], dtype=torch.long)
        logits = _logits(model(src, torch.zeros(seqs, S, dtype=torch.long)))
    else:
        logits = _logits(model(torch.zeros(seqs, S, dtype=torch.long)))
    loss = chunked_cross_entropy(logits.reshape(-1, V), torch.zeros(seqs * S, dtype=torch.long))
    (loss + collect_aux_loss(model).to(loss.device)).backward()


def _per_param_bytes(optimizer: str) -> tuple:
    """(optimizer step, gradient norm + clip) census bytes per parameter byte, on one fp32
    [256, 256] parameter: AdamW's fused kernel (what train.optimizer_impl=auto takes on a
    GPU; Muon's element-wise work is of its size too) or Adafactor."""
    from optim.adafactor import Adafactor
    from ..grads import clip_, grad_norm
    p = torch.nn.Parameter(torch.zeros(256, 256))
    p.grad = torch.zeros_like(p)
    opt = Adafactor([p]) if optimizer == "adafactor" else torch.optim.AdamW([p], fused=True)
    opt.step()  # the state exists from here on
    with OpCensus() as step:
        opt.step()
    with OpCensus() as norm:
        items = [(p.grad, 1.0)]
        clip_(items, grad_norm(items, p.device, False), 1.0)
    size = p.numel() * p.element_size()
    return step.bytes / size, norm.bytes / size


def _keep_representatives(model) -> dict:
    """Cut each stack of blocks down to one block per kind (its first block, MoE or dense:
    blocks of a kind run the same ops); {(stack, index): the kept block} for every block."""
    kind_of, rep = {}, {}
    for s, stack in enumerate(block_stacks(model)):
        for i, b in enumerate(stack):
            kind = (s, i == 0, any(isinstance(m, MoELayer) for m in b.modules()))
            rep.setdefault(kind, b)
            kind_of[s, i] = rep[kind]
        for i in reversed(range(len(stack))):
            if kind_of[s, i] is not stack[i]:
                del stack[i]
    return kind_of


def _trace(model, w) -> list:
    """[{unit: census bytes}] of one micro-batch: of one sequence, of one again with the
    expert banks' compute-dtype weights cached (what later micro-batches of a step reuse),
    and of two sequences."""
    banks = [m for m in model.modules() if isinstance(m, ExpertBank)]
    where, traces = _Attribution(model), []
    try:
        for seqs, cached in ((1, False), (1, True), (2, False)):
            for bank in banks if not cached else ():
                bank.set_cast_cache(True)  # empties the cache: this micro-batch casts
            model.zero_grad(set_to_none=True)
            census = _UnitCensus(where)
            with census:
                _forward_backward(model, w, seqs)
            traces.append(census.by_unit)
    finally:
        where.close()
    return traces


def step_bytes(w, precision: str, param_dtype: str = "fp32") -> StepBytes:
    """The workload's memory-bound bytes by unit (see the module doc): a second for a small
    model, a few for a large one; the planner keeps one per precision and parameter dtype
    (predict.StateCache). param_dtype=bf16: the parameters held in bf16 as the run holds
    them (parallel/apply.py: no weight casts, a bf16 residual stream)."""
    model = w.build_model()
    held = DTYPES[param_dtype].itemsize if param_dtype != "fp32" else None  # bytes per element
    params = sum(p.numel() * (held or p.element_size()) for p in model.parameters())
    kept_of = _keep_representatives(model)
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fake tensors have no data pointer to warn about
        model = model.to_empty(device="cpu")
        for m in model.modules():
            if isinstance(m, ExpertBank):  # the grouped GEMMs a GPU runs
                m.experts_impl = "grouped_mm"
        for p in model.parameters() if param_dtype != "fp32" else ():
            p.data = p.data.to(DTYPES[param_dtype])   # as ZeRO's cast_params holds them
        apply_precision(model, precision)  # bf16 autocast as the run applies it (fp8: as bf16)
        with gpu_kernels():  # the norms as the GPU runs them (gpu_kernels.py)
            traces = _trace(model, w)
        optimizer, norm = _per_param_bytes(w.optimizer)
    T = sum(w.stream_tokens.values())
    kept = {b: i for i, b in enumerate(blocks(model))}
    one, cached, two = ({u: t.get(u, 0) for u in set().union(*traces)} for t in traces)
    by_kept = {u: UnitBytes(per_token=(two[u] - one[u]) / T,
                            per_micro=max(0.0, 2 * one[u] - two[u] - (one[u] - cached[u])),
                            per_step=max(0.0, one[u] - cached[u])) for u in one}
    units = {key: by_kept.get(kept[b], UnitBytes()) for key, b in kept_of.items()}
    units[ENDS] = by_kept.get(ENDS, UnitBytes())
    return StepBytes(units, params, optimizer, norm)


def _units_on(sb: StepBytes, block_ids, last_stage: bool) -> list:
    """The units a rank runs: its blocks (by index in any stack), and the ends on the last stage."""
    on_rank = set(block_ids)
    return [u for u in sb.units if u != ENDS and u[1] in on_rank] + ([ENDS] if last_stage else [])


def token_bytes(sb: StepBytes, w, plan, block_ids, last_stage: bool) -> float:
    """The per-token part of rank_bytes for these blocks (and the ends on the last stage):
    the part every layout of the plan's degrees pays, the search's lower bound."""
    tokens = w.batch_size / plan.dp * sum(w.stream_tokens.values()) / (plan.tp * plan.cp)
    return tokens * sum(sb.units[u].per_token for u in _units_on(sb, block_ids, last_stage))


def rank_bytes(sb: StepBytes, w, plan, state, micro_seqs: float, micro_count: int) -> float:
    """This rank's memory-bound bytes per optimizer step (module doc)."""
    tokens = micro_seqs * sum(w.stream_tokens.values()) / (plan.tp * plan.cp)
    share = state.params.bytes / sb.param_bytes if sb.param_bytes else 1.0
    mine = _units_on(sb, w.blocks_on(state, plan), state.last_stage)
    per_micro = sum(sb.units[u].per_token * tokens + sb.units[u].per_micro * share for u in mine)
    casts = sum(sb.units[u].per_step for u in mine) * share
    per_micro += casts if plan.zero == 3 else 0.0  # FSDP2 gathers afresh: no cached cast
    once = 0.0 if plan.zero == 3 else casts
    grads = state.params.bytes
    stepped = state.slices.bytes if plan.zero in (1, 2) else \
        sum(u[2] for u in state.fsdp_units) if plan.zero == 3 else grads
    return (micro_count * per_micro + once + 3 * grads * (micro_count - 1)
            + sb.norm_per_byte * stepped + sb.optimizer_per_byte * stepped)
