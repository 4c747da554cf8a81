"""Training FLOPs per step and rank, counted from the parameters of the real model.

Forward FLOPs per token = 2 x (matmul weights it passes through) + attention:
  matmul weights: every parameter with >= 2 dims outside embeddings (attention, dense FFN,
  router, shared experts, output head; a tied head counts as the matmul it is); an expert
  bank counts top_k / num_experts of its weights (each token visits K experts);
  attention: 2 x key length x H x (qk width + v width) per token per attention module
  (QK^T and AV; 4 x key length x D for plain multi-head attention), key length = the
  stream's tokens (cross-attention: the encoder's), halved for causal self-attention (the
  decoder's: a query sees the keys before it, and the fused kernels skip the masked half).
Multi-token prediction depths (model.mtp_depth, models/mtp.py) are units of their own, block
index MTP_BASE + k: their projection and block as above, plus the shared output head once
per depth (each depth scores its tokens through it).
This is Megatron-LM's convention for model TFLOP/s (causal attention counted half; its MTP
layers count as the blocks they are and their output layers once each, as here; its padded
vocabulary is the vocabulary of the published runs compared here, all multiples of 128),
which the planner
and train.py's telemetry both report; tokens/s per GPU beside it needs no convention.
Backward = 2 x forward; full recomputation adds one forward: 3x or 4x forward per step.
Selective recomputation (parallel.recompute_modules) adds the forward of its parts only:
experts (their top_k/E share, times the imbalance), shared_experts, mlp (dense FFNs) and
mla_up_proj (wq_b and wkv_b, or MLA's wq without a query latent) by their matmul weights,
core_attn by the attention term; layernorm and moe_act are elementwise (counted 0).
model_flops (TFLOP/s per GPU, MFU) counts 3x, the whole model and batch, no imbalance.
Per rank: its pipeline stage's blocks (+ head on the last stage), its 1/dp of the batch,
split over tp (heads, FFN columns, vocabulary, and whole sequences in MoE layers); the
expert part of an expert-parallel rank is scaled by the stated routing imbalance (the
busiest rank computes `imbalance` x the mean rows).
"""
import re
from dataclasses import dataclass, field

from ..kinds import is_expert_param

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|h|layers|block)\.(\d+)\.")
_MTP = re.compile(r"(?:^|\.)mtp\.(\d+)\.")
MTP_BASE = 1 << 20  # MTP depth k's unit is block MTP_BASE + k: past any model's blocks


@dataclass
class Unit:
    """Forward cost per token of one block (or of what lies outside the blocks)."""
    stream: str
    dense_params: int = 0          # matmul weights every token passes through
    expert_params: float = 0.0     # top_k/E of the expert banks' weights
    attention_modules: int = 0
    cross_attention: int = 0
    parts: dict = field(default_factory=dict)  # recompute part -> its matmul weights (dense)


@dataclass
class ModelCosts:
    units: dict = field(default_factory=dict)   # (stream, block index or -1) -> Unit
    score_width: int = 0    # multiply-adds per (query, key) pair over all heads (QK^T + AV)
    mtp_params: int = 0     # parameters of the multi-token prediction depths (models/mtp.py)
    step_bytes: object = None  # traced_bytes.StepBytes the search bounds with (None: not priced)


def _stream(name: str) -> str:
    return "encoder" if name.startswith("encoder.") or ".encoder." in name else "decoder"


def model_costs(model, workload) -> ModelCosts:
    """Per-block forward costs of the single-device meta model."""
    top_k, E = (workload.moe_cfg.top_k, workload.moe_cfg.num_experts) if workload.has_moe() else (1, 1)
    out = ModelCosts(score_width=workload.model_cfg.attention_score_width())
    for mname, mod in model.named_modules():
        kind = type(mod).__name__
        key = _key(mname + ".")
        if "Attention" in kind and not any("Attention" in type(c).__name__ for c in mod.children()):
            unit = out.units.setdefault(key, Unit(key[0]))
            if "cross" in mname.lower() or "EncDecAttention" in mname:
                unit.cross_attention += 1
            else:
                unit.attention_modules += 1
        if "Embedding" in kind:
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() < 2:
                continue
            unit = out.units.setdefault(key, Unit(key[0]))
            if is_expert_param(f"{mname}.{pname}"):
                unit.expert_params += p.numel() * top_k / E
            else:
                unit.dense_params += p.numel()
                part = _part(mname, workload.model_cfg)
                if part:
                    unit.parts[part] = unit.parts.get(part, 0) + p.numel()
    head = getattr(model, "lm_head", None)
    out.mtp_params = sum(p.numel() for n, p in model.named_parameters() if _MTP.search(n))
    for k in range(len(getattr(model, "mtp", None) or [])):  # each depth runs the shared head
        out.units[("decoder", MTP_BASE + k)].dense_params += head.weight.numel()
    return out


def _part(mname: str, m) -> str | None:
    """The selective-recomputation part a dense matmul weight belongs to (gpt blocks)."""
    if ".shared_experts." in mname + ".":
        return "shared_experts"
    if mname.endswith(".ffn.bank"):
        return "mlp"
    if getattr(m, "attention", "mha") == "mla" and re.search(r"\.attn\.(wq_b|wkv_b|wq)$", mname):
        return "mla_up_proj"
    return None


def recompute_flops(costs: ModelCosts, workload, unit: Unit, parts, imbalance: float = 1.0,
                    gemm_time: float = 1.0) -> float:
    """Forward FLOPs per token selective recomputation adds to one unit (module docstring);
    gemm_time scales its GEMMs' (see rank_flops)."""
    out = sum(2 * unit.parts.get(p, 0) for p in parts) * gemm_time
    if "experts" in parts:
        out += 2 * unit.expert_params * imbalance * gemm_time
    if "core_attn" in parts:
        out += _self_attention_flops(costs, workload, unit)
    return out


def _self_attention_flops(costs: ModelCosts, workload, unit: Unit) -> float:
    """QK^T and AV of the unit's self-attention per token: the stream's tokens as keys,
    halved for the decoder's (causal) attention."""
    causal = 0.5 if unit.stream == "decoder" else 1.0
    S = workload.stream_tokens.get(unit.stream, 0)
    return 2 * costs.score_width * causal * S * unit.attention_modules


def _key(name: str) -> tuple:
    mtp = _MTP.search(name)
    if mtp:
        return ("decoder", MTP_BASE + int(mtp.group(1)))
    m = _BLOCK.search(name)
    return (_stream(name), int(m.group(1)) if m else -1)


def token_flops(costs: ModelCosts, workload, unit: Unit, imbalance: float = 1.0,
                gemm_time: float = 1.0) -> float:
    """Forward FLOPs per token of one unit (the module docstring's count); gemm_time scales
    its GEMMs' (see rank_flops)."""
    S = workload.stream_tokens.get(unit.stream, 0)
    enc = workload.stream_tokens.get("encoder", 0)
    per_token = 2 * (unit.dense_params + unit.expert_params * imbalance) * gemm_time
    return (per_token + _self_attention_flops(costs, workload, unit)
            + 2 * costs.score_width * (enc or S) * unit.cross_attention)


def mtp_flops_per_token(costs: ModelCosts, workload) -> float:
    """Model FLOPs (3 x forward) per decoder token of the MTP depths (0 without them)."""
    return 3 * sum(token_flops(costs, workload, u) for (_, b), u in costs.units.items()
                   if b >= MTP_BASE)


def model_flops(costs: ModelCosts, workload, imbalance: float = 1.0) -> float:
    """Model FLOPs of one optimizer step: the whole model on the global batch, forward and
    backward (3 x forward), no recomputation and no routing imbalance -- the numerator of
    TFLOP/s per GPU and MFU as published runs state them. (With `imbalance`: the sum of
    every rank's rank_flops without recomputation, the planner's search bound.)"""
    total = 0.0
    for u in costs.units.values():
        tokens = workload.batch_size * workload.stream_tokens.get(u.stream, 0)
        total += token_flops(costs, workload, u, imbalance) * tokens
    return 3 * total


def rank_flops(costs: ModelCosts, workload, plan, state, expert_slowdown: float = 1.0,
               fp8_time: float = 1.0) -> float:
    """Training FLOPs this rank runs in one optimizer step; expert_slowdown > 1 counts the
    expert GEMMs' FLOPs that many times (step_time.expert_gemm_slowdown: FLOPs at the
    preset's rate that take as long as the real ones at their shape); fp8_time < 1 counts
    the blocks' GEMMs (not the head's, not attention's scores) that many times
    (step_time.fp8_gemm_time: their time at the FP8 rate over the bf16 one). Both give
    FLOPs at the preset's rate that take the real time, not FLOPs run."""
    passes = 4 if plan.recompute == "full" else 3
    seqs = workload.batch_size / plan.dp
    imbalance = (workload.imbalance if plan.ep > 1 else 1.0) * expert_slowdown
    total = extra = 0.0
    for (stream, block), u in costs.units.items():
        if not _on_rank(stream, block, state, plan):
            continue
        tokens = seqs * workload.stream_tokens.get(stream, 0) / plan.cp  # a cp rank's queries; keys: all S
        gemm = fp8_time if block >= 0 else 1.0
        total += token_flops(costs, workload, u, imbalance, gemm) * tokens
        if plan.recompute == "selective":
            extra += recompute_flops(costs, workload, u, plan.recompute_parts, imbalance, gemm) * tokens
    return (passes * total + extra) / plan.tp


def _on_rank(stream, block, state, plan) -> bool:
    if plan.pp == 1:
        return True
    if 0 <= block < MTP_BASE:
        return block in state.block_ids
    return state.last_stage  # the head (embeddings have no matmul), the MTP depths
