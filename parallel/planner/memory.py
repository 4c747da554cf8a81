"""Per-rank memory: model state by device (exact, from the rank's real tensors) and an
activation model; the peak is the largest of three phases of a step.

Model state (what ZeRO partitions; rank_state.py reads the local tensors):
  params     the local parameter tensors (tp/ep/pp pieces; FSDP2 shards at zero 3)
  grads      held after the reduction: zero 0/1 the full local gradients (ZeRO-1 keeps only
             its slice after the step, it reduces them in full), zero 2 the slices, zero 3
             the shards
  optimizer  AdamW: 2 moments per stepped element + a 4-byte step per tensor, stepping
             params (zero 0, 3) or fp32 master slices (zero 1, 2, which count here too);
             Adafactor: a row and a column statistic per matrix, a full one otherwise;
             Muon: one momentum buffer per element of its matrices (no step), AdamW's
             state for the rest
The *_by_device functions return {device: bytes}: "gpu" the accelerator, "cpu" the host.
parallel.offload moves: optimizer -> the optimizer state and its fp32 masters (ZeRO-1/2's
slices; under ZeRO-3 a host copy of every shard) to "cpu", and the held gradients with them
(ZeRO-2's slices; ZeRO-3's shards after the step); params (ZeRO-3) -> parameters, gradients
and optimizer state to "cpu" (FSDP2's CPUOffloadPolicy). The peak counts "gpu" bytes only.

Activations, per token of a micro-batch on this rank, in elements of the activation dtype
(4 bytes fp32, 2 bytes bf16/fp16 autocast), from what the blocks save for backward (under
autocast the two norms' inputs are the fp32 residual stream: 4/a elements each):
  attention block part   8 D  (norm in/out, q, k, v, rotated q/k, attention output)
                         + 5 D per cross-attention
  dense FFN              2 D + 2 F (3 F gated)
  MoE FFN                2 D + 2 E fp32 (router logits/probs)
                         + r K (2 D + 2 F_e (3 F_e gated))   dispatched rows: the experts'
                         input and the combine's saved output (etp: (1 + etp) D); under
                         moe.gates_in_experts r K (D + F_e (2 F_e gated) + an fp32 gate):
                         no output, and no activation output but under fp8 (moe/row_gates.py)
                         + 2 F_s (3 F_s gated)   shared experts, F_s = their d_ff in all
  with r = 1 locally, the imbalance (busiest rank, capped by the capacity factor) under ep.
  recompute=full keeps D per block and rebuilds one block at a time in backward.
  recompute=selective frees, per token of a block (and rebuilds one block's at a time):
    layernorm       what the readers of the two norms' outputs keep of them (measured:
                    tests/unit/test_selective_recompute.py, tests/dist/test_activation_terms.py):
                    the attention's input, tp D (1-D tp's gathered copy, gathered again in
                    backward; D without tp; under autocast the projections' one bf16 copy,
                    moe/cast_once.py, FP8 projections' too on a GPU); the FFN norm's output where its readers keep it as it is (the
                    stream in the activation dtype): a dense FFN's gathered copy, tp D, the
                    MoE router's input in fp32, D; under autocast over the fp32 stream the MoE
                    router's fp32 input (autocast off), 4/a D, a dense FFN nothing (its casts)
    moe_act         r K F_e + F_s (the activation outputs)
    experts         r K (2 F_e, 3 F_e gated) (the experts' hidden)
    shared_experts  2 F_s (3 F_s gated); mlp: 2 F (3 F gated) of a dense block
    mla_up_proj     2 (q_lora_rank + kv_lora_rank) + (1 or 2) x 4/a (the latents before and
                    after their norms, which the recomputed part runs, and the norms' rstd)
    core_attn       H x 4/a (the fused kernel's log-sum-exp; its q, k, v and output are
                    kept by the layers around it)
  Sequence parallelism and MoE sequence splitting divide all of it by tp, but for the
  attention's input and a dense FFN's, which 1-D tensor parallelism gathers over the sequence
  before the column-parallel projections keep them: (tp - 1) D more each. The 2-D grid
  (tp_mode 2d/2.5d) is modelled the same way: its gathered matmul inputs (2 T D/(d q) per
  block) are larger than T D/tp, its other tensors are T x/tp (bench/tensor_parallel.py).
  The last stage adds the loss: the logits and their gradient, 2 x a bytes per vocabulary
  entry per token (vocabulary gathered: not divided by tp); models/cross_entropy.py keeps
  no fp32 copy or log-probabilities, and its chunks' fp32 work stays inside one fused op.
  Pipeline stages keep schedule.in_flight() micro-batch-chunks of it.
  Multi-token prediction (model.mtp_depth = K, models/mtp.py): each depth adds a block as the
  last one (recomputed as the blocks are) + MTP_EXTRA D outside it (the embedding's norm in
  and out, the hidden state's norm out, their concatenation 2 D, the depth's final norm in and
  out), and the loss term once more per depth (its logits and their gradient).
  a2a_overlap=1f1b: without pp one micro-batch plus the blocks the next one's forward
  builds before its first expert all-to-all (through the first MoE block); under pp
  at least two micro-batch-chunks.
Phases (each on top of params + optimizer state):
  forward end     activations (+ autocast's 16-bit copies of the GEMM weights under
                  precision bf16/fp16 with fp32 parameters, fp8: those outside the blocks;
                  + 2bw's stashed weight version or pending gradient;
                  + zero 3: 1 + max(1, parallel.zero_prefetch) gathered FSDP units, this
                  one and those prefetched;
                  + the gradients when earlier micro-batches of the step made them)
  gradient sync   full gradients + the flat copy all_reduce_flat / reduce-scatter make of
                  the largest bucket (zero 3: the largest unit's unsharded gradient)
  optimizer step  held gradients + two temporaries of the largest parameter
                  (zero 1/2: + the all-gathered rows of the largest bucket; Muon on pieces:
                  + the owner's received pieces, each owned matrix whole and two
                  Newton-Schulz temporaries of it)
"""
import dataclasses
from dataclasses import dataclass

from ..pipeline.schedules import in_flight
from .rank_state import muon_facts

LOSS_COPIES_PER_LOGIT = 2   # the logits and their gradient, in the activations' dtype
MTP_EXTRA = 7               # elements x D per token an MTP depth saves outside its block
DEVICE = "gpu"


def fsdp_wire_ratio(plan) -> float:
    """Bytes FSDP2 gathers and reduces per byte of its fp32 shards: under param_dtype=bf16 it
    moves (and holds gathered) bf16 casts."""
    return 0.5 if plan.param_dtype == "bf16" else 1.0


def act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def stream_bytes(plan) -> int:
    """Bytes an element of the residual stream (and of the norms' outputs) takes: fp32 under
    autocast with fp32 parameters (the embedding's output and the sums stay fp32), else the
    activations' dtype. 1-D tp gathers the norms' outputs and reduce-scatters their gradients
    in it (measured: tests/e2e/test_planner_validation.py's bf16 tp row)."""
    a = act_bytes(plan.precision)
    return 4 if a != 4 and plan.param_dtype == "fp32" else a


# ---------------------------------------------------------------- model state, by device
HOST = "cpu"


def param_bytes_by_device(state, plan) -> dict:
    return {HOST if plan.offload == "params" else DEVICE: state.params.bytes}


def grad_bytes_by_device(state, plan) -> dict:
    if plan.zero == 2 and state.slices.count:
        held = sum(b[4] for b in state.buckets)
    else:
        held = state.params.bytes
    on_host = plan.offload == "params" or (plan.offload == "optimizer" and plan.zero in (2, 3))
    return {HOST if on_host else DEVICE: held}


def optimizer_bytes_by_device(state, plan, optimizer: str = "adamw") -> dict:
    sliced = plan.zero in (1, 2) and state.slices.count > 0
    stepped = state.slices if sliced else state.params
    master = stepped.bytes if sliced or (plan.zero == 3 and plan.offload == "optimizer") else 0
    steps = stepped.count
    if optimizer == "adafactor":
        moments = sum(_factored(s) for s in stepped.shapes) * 4
    elif optimizer == "muon" and muon_facts(state, plan) is not None:  # one buffer, no step
        muon = muon_facts(state, plan)
        moments = 2 * (stepped.bytes - muon.stepped_bytes) + muon.stepped_bytes
        steps -= muon.stepped_count
    else:
        moments = 2 * stepped.bytes
    return {HOST if plan.offload != "none" else DEVICE: master + moments + 4 * steps}


def _factored(shape) -> int:
    if len(shape) < 2:
        n = 1
        for d in shape:
            n *= d
        return n
    lead = 1
    for d in shape[:-2]:
        lead *= d
    return lead * (shape[-2] + shape[-1])


def model_state(state, plan, optimizer="adamw") -> dict:
    return {"params": param_bytes_by_device(state, plan),
            "grads": grad_bytes_by_device(state, plan),
            "optimizer": optimizer_bytes_by_device(state, plan, optimizer)}


def async_save_host_bytes(model_state_bytes: dict) -> int:
    """Host memory a rank's checkpoint.async save stages: DCP copies every tensor of the
    rank's state to the host before writing in the background -- its parameters (the fp32
    master slices in their place under parallel.param_dtype=bf16) and its optimizer state,
    at most the two together (ZeRO-1/2's master slices, counted in the optimizer state, are
    not saved beside fp32 parameters). A synchronous save stages one tensor at a time, and
    no layout gathers anything to save: ZeRO-1/2 slices and FSDP2 shards are written where
    they lie (parallel/data_parallel/zero_shards.py)."""
    return int(sum(model_state_bytes["params"].values()) + sum(model_state_bytes["optimizer"].values()))


# ---------------------------------------------------------------- activations
def block_act_elems(w, i: int, stream: str, plan) -> float:
    """Saved elements per token of block i (activation dtype; router fp32 in the MoE term)."""
    return sum(block_act_terms(w, i, stream, plan).values())


def block_act_terms(w, i: int, stream: str, plan) -> dict:
    """block_act_elems by what holds them: {term: elements per token} (the module docstring's
    list; `--layout` prints them for a stage's first MoE block)."""
    m, a = w.model_cfg, act_bytes(plan.precision)
    D = m.d_model
    out = {"norms (inputs, outputs)": 4 * D, "attention (q, k, v, output)": m.attention_saved_width()}
    if stream == "decoder" and "encoder" in w.stream_tokens:
        out["cross-attention"] = 5 * D
    if w.is_moe_block(i):
        moe = w.moe_cfg
        r = w.imbalance if plan.ep > 1 else 1.0
        if plan.ep > 1 and moe.capacity_factor:
            r = min(r, moe.capacity_factor)
        hidden = _routed_hidden(w, plan)
        # per routed row: the experts' input D (the grouped FFN's saved x) and output D (the
        # weighted combine's saved y), and the expert's hidden; under etp each rank holds the
        # etp rows of its group (etp x D) with 1/etp of the hidden each
        out["moe input, output"] = 2 * D
        out["router (fp32 logits, probabilities)"] = 2 * moe.num_experts * 4 / a
        out["expert rows in"] = r * moe.top_k * D
        if getattr(moe, "gates_in_experts", False):   # the combine keeps nothing; the experts
            out["gates kept by the experts (fp32)"] = r * moe.top_k * plan.etp * 4 / a  # a gate a row
        else:
            out["combine's saved expert outputs"] = r * moe.top_k * plan.etp * D
        out["expert hidden"] = r * moe.top_k * hidden
        if _shared_d_ff(w):
            out["shared experts' hidden"] = (3 if w.gated else 2) * _shared_d_ff(w)
    else:
        out["ffn input, output"] = 2 * D
        out["ffn hidden"] = (3 if w.gated else 2) * m.d_ff
    if a != 4:  # autocast: the residual stream stays fp32 (the embedding's output plus fp32
        out["fp32 residual under autocast"] = 2 * D * (4 / a - 1)  # sums): fp32 norm inputs
    if plan.tp > 1 and plan.tp_mode == "1d":
        # sequence parallelism gathers the attention's input (and a dense FFN's) before its
        # column-parallel projections, which keep it whole: tp D where the norm output above
        # counts D (parallel/tensor/one_d.py; the MoE FFN runs on the sequence shards)
        readers = 1 if w.is_moe_block(i) else 2
        out["tp-gathered matmul inputs"] = readers * (plan.tp - 1) * D
    return out


def first_block_terms(w, plan, state) -> dict:
    """block_act_terms of the stage's first MoE block (its first block when none is MoE;
    {} for a stage without blocks), of the decoder stream."""
    blocks = list(w.blocks_on(state, plan))
    pick = next((i for i in blocks if w.is_moe_block(i)), blocks[0] if blocks else None)
    return {} if pick is None else block_act_terms(w, pick, "decoder", plan)


def gates_in_experts_saving(w, plan, state, terms: dict) -> float:
    """Elements per token the stage's first MoE block (its first_block_terms, `terms`) would
    keep less with moe.gates_in_experts on (0 when it is on already, or no MoE block)."""
    if "combine's saved expert outputs" not in terms:
        return 0.0
    on = dataclasses.replace(w, moe_cfg=dataclasses.replace(w.moe_cfg, gates_in_experts=True))
    return sum(terms.values()) - sum(first_block_terms(on, plan, state).values())


def _shared_d_ff(w) -> int:
    return w.moe_cfg.num_shared_experts * w.expert_d_ff


def _fused_gates(w, plan) -> bool:
    """moe.gates_in_experts on the fused expert paths (every precision but fp8): the gated
    hidden is computed again in backward (moe/row_gates.py), never kept; the FP8 paths' GEMM
    keeps it as its input."""
    return bool(getattr(w.moe_cfg, "gates_in_experts", False)) and plan.precision != "fp8"


def _routed_hidden(w, plan) -> int:
    """Elements of a routed row's hidden the experts keep: the pre-activations (2 F gated,
    else F) and the activation output F, which fused gates do not keep."""
    glu = 3 if w.gated else 2
    return (glu - 1 if _fused_gates(w, plan) else glu) * w.expert_d_ff


def recompute_saved_elems(w, i: int, plan) -> float:
    """Elements per token (activation dtype) selective recomputation frees in block i: the
    terms FREED_ELEMS gives for each of the plan's parts (the module docstring's list)."""
    b = _BlockFacts.of(w, i, plan)
    out = 0.0
    for part, terms in FREED_ELEMS.items():   # the table's order: the sum's order, fixed
        if part in b.parts:
            for term in terms(b):
                out += term
    return out


@dataclass(frozen=True)
class _BlockFacts:
    """What the parts' freed elements of one block are computed from."""
    parts: frozenset
    m: object        # the model config
    a: int           # bytes per activation element
    D: int
    glu: int         # the FFN's hidden tensors per d_ff column: 3 gated, else 2
    moe: bool        # an MoE block
    r: float         # routed rows per assignment on this rank (the imbalance under ep)
    top_k: int
    F_e: int         # an expert's d_ff
    F_s: int         # the shared experts' d_ff (0 in a dense block)
    hidden: int      # a routed row's kept hidden (_routed_hidden; 0 in a dense block)
    fused_gates: bool  # no activation output kept for routed rows (_fused_gates)
    tp: int          # 1-D tensor parallelism's ranks (its gathered inputs are tp D)
    stream: int      # bytes of a residual-stream element (stream_bytes)

    @classmethod
    def of(cls, w, i: int, plan) -> "_BlockFacts":
        moe = w.is_moe_block(i)
        r = 1.0
        if moe and plan.ep > 1:
            r = min(w.imbalance, w.moe_cfg.capacity_factor or w.imbalance)
        return cls(frozenset(plan.recompute_parts), w.model_cfg, act_bytes(plan.precision),
                   w.model_cfg.d_model, 3 if w.gated else 2, moe, r,
                   w.moe_cfg.top_k if moe else 0, w.expert_d_ff if moe else 0,
                   _shared_d_ff(w) if moe else 0, _routed_hidden(w, plan) if moe else 0,
                   moe and _fused_gates(w, plan), plan.tp if plan.tp_mode == "1d" else 1,
                   stream_bytes(plan))


def _layernorm_freed(b) -> tuple:
    """The norms' outputs (or what is announced as made from them) that their readers keep
    (the module docstring): (attention's, the FFN's)."""
    attention = b.tp * b.D   # the projections' input: gathered under tp, their one cast under autocast
    if b.stream == b.a:   # fp32, or bf16 parameters: the readers keep the output itself
        # a dense FFN its gathered copy; an MoE layer's router casts its own fp32 copy but in fp32
        ffn = b.tp * b.D if not b.moe else (b.D if b.a == 4 else 0.0)
    else:                 # autocast over the fp32 stream: the router (autocast off) keeps the
        ffn = b.D * b.stream / b.a if b.moe else 0.0   # fp32 output, the dense FFN its casts
    return tuple(t for t in (attention, ffn) if t)


def _experts_freed(b) -> tuple:
    return (b.r * b.top_k * b.hidden,) if b.moe else ()


def _moe_act_freed(b) -> tuple:
    """The activation outputs, where experts / shared_experts do not free them already."""
    if not b.moe:
        return ()
    routed = () if "experts" in b.parts or b.fused_gates else (b.r * b.top_k * b.F_e,)
    return routed + (() if "shared_experts" in b.parts else (b.F_s,))


def _shared_experts_freed(b) -> tuple:
    return (b.glu * b.F_s,) if b.moe else ()


def _mlp_freed(b) -> tuple:
    return () if b.moe else (b.glu * b.m.d_ff,)


def _mla_up_proj_freed(b) -> tuple:
    if getattr(b.m, "attention", "mha") != "mla":
        return ()
    # the latents before and after their RMSNorms (the norms run inside the recomputed part:
    # LatentAttention.up) and each norm's fp32 reciprocal root
    norms = 2 if b.m.q_lora_rank else 1
    return (2 * (b.m.q_lora_rank + b.m.kv_lora_rank) + norms * 4 / b.a,)


def _core_attn_freed(b) -> tuple:
    return (b.m.n_heads * 4 / b.a,)


# what each part of parallel/recompute_parts.py frees, as terms of elements per token (the
# same keys: tests/unit/test_recompute_parts.py); the order is the sum's
FREED_ELEMS = {"layernorm": _layernorm_freed, "experts": _experts_freed, "moe_act": _moe_act_freed,
               "shared_experts": _shared_experts_freed, "mlp": _mlp_freed,
               "mla_up_proj": _mla_up_proj_freed, "core_attn": _core_attn_freed}


@dataclass
class Activations:
    per_microbatch: int     # one micro-batch through this rank's chunk(s)
    in_flight: int          # micro-batch-chunks alive at once
    loss: int               # the last stage's loss temporaries (one micro-batch)
    total: int
    microbatches: int       # forward+backward passes per step on this rank
    fp8_copies: int = 0     # precision=fp8: one GEMM's transient quantized copies (fp8_copy_bytes)


def micro_seqs(w, plan) -> float:
    local = w.batch_size / plan.dp
    if plan.pp > 1:
        return local / plan.microbatches
    return w.micro_batch_size or local


def local_tokens(plan, S: int) -> float:
    """Tokens of one sequence on a rank: its cp part (parallel/context/split.py)."""
    return S / plan.cp


def activations(w, plan, state, stage: int) -> Activations:
    a, seqs = act_bytes(plan.precision), micro_seqs(w, plan)
    per_block = {}
    for stream, S in w.stream_tokens.items():
        for i in w.blocks_on(state, plan):
            tokens = seqs * local_tokens(plan, S) / plan.tp
            kept, full = _kept_and_full(w, i, stream, plan, tokens, a)
            if i >= w.model_cfg.n_layers:  # an MTP depth: what lies around its block
                around = MTP_EXTRA * w.model_cfg.d_model * tokens * a
                kept, full = kept + around, full + around
            per_block[(stream, i)] = (kept, full)
    kept = sum(k for k, _ in per_block.values())
    rebuild = 0  # backward rebuilds one block at a time: all of it, or what selective dropped
    if plan.recompute == "full":
        rebuild = max((f for _, f in per_block.values()), default=0)
    elif plan.recompute == "selective":
        rebuild = max((f - k for k, f in per_block.values()), default=0)
    chunks = plan.stages_per_rank
    flight = in_flight(plan.pp_schedule, plan.pp, plan.microbatches, stage, chunks)
    lead = 0
    if plan.a2a_overlap == "1f1b" and plan.pp == 1:
        # the forward of i+1 runs beside the backward of i, the baton changing hands at every
        # expert all-to-all (parallel/interleave.py): the backward frees a block for each
        # block the forward builds, so i+1 is ahead by what it builds before its first
        # exchange: the blocks up to and including the first MoE one (measured, dp2 ep2
        # 6 MoE blocks: +0.2 of a micro-batch, not +1)
        for (_, i), (k, _) in per_block.items():
            lead += k
            if w.is_moe_block(i):
                break
    elif plan.a2a_overlap == "1f1b":  # a pipeline's pairs: at least two micro-batch-chunks
        flight = max(flight, 2)
    per_chunk = kept / chunks
    loss = 0
    if state.last_stage:
        S_out = w.stream_tokens["decoder"]
        # each MTP depth's logits too, saved until the backward; one gradient at a time
        loss = int(seqs * local_tokens(plan, S_out) * w.model_cfg.vocab_size * a
                   * (LOSS_COPIES_PER_LOGIT + len(w.mtp_block_ids())))
    total = int(per_chunk * flight + lead + rebuild + loss)
    passes = plan.microbatches if plan.pp > 1 else round(w.batch_size / plan.dp / seqs)
    return Activations(int(kept), flight, loss, total, passes, fp8_copy_bytes(w, plan))


def _kept_and_full(w, i: int, stream: str, plan, tokens: float, a: int) -> tuple:
    """(bytes block i keeps for backward under the plan's recomputation, bytes it saves
    without it) for `tokens` tokens."""
    full = block_act_elems(w, i, stream, plan) * tokens * a
    if plan.recompute == "full":
        return w.model_cfg.d_model * tokens * a, full
    if plan.recompute == "selective":
        return full - recompute_saved_elems(w, i, plan) * tokens * a, full
    return full, full


def autocast_copy_bytes(state, plan) -> int:
    """precision=bf16/fp16 (fp8: outside the blocks, whose GEMMs run in FP8) with fp32
    parameters: autocast's 16-bit copy of every GEMM weight (and the expert banks' copy,
    kept across micro-batches: moe/experts.py), saved by the GEMMs for their backward, so
    alive at the forward's end; none when the parameters are already 16-bit
    (parallel.param_dtype=bf16) or in fp32 runs."""
    if plan.precision not in ("bf16", "fp16", "fp8") or plan.param_dtype != "fp32":
        return 0
    blocks, rest = state.matmul_bytes
    return (rest if plan.precision == "fp8" else blocks + rest) // 2


def fp8_copy_bytes(w, plan) -> int:
    """precision=fp8: what the widest FP8 GEMM of the blocks holds while it runs (moe/fp8.py
    quantizes again in backward, so nothing lives between the passes): its weight [D, F]
    and its input [T, F] (T this rank's tokens of a micro-batch, at most) each as e4m3
    values (1 byte) and their dequantized fp32 values (4), plus one fp32 scale per 128 x 128
    block and per 1 x 128 tile. F: the widest of d_ff and the experts' d_ff / etp."""
    if plan.precision != "fp8":
        return 0
    m = w.model_cfg
    F = max(m.d_ff, w.expert_d_ff / plan.etp if w.has_moe() else 0, m.d_model)
    T = micro_seqs(w, plan) * local_tokens(plan, w.stream_tokens["decoder"]) / plan.tp
    weight, inputs = m.d_model * F, T * F
    return int(5 * (weight + inputs) + 4 * (weight / 128 ** 2 + inputs / 128))


def stashed_bytes(state, plan) -> int:
    """PipeDream-2BW (parallel/pipeline/twobw.py) holds one more weight-sized set per stage: the
    stashed version the in-flight backwards of the previous step use (stages before the
    last), or the last stage's gradient of the current step awaiting its delayed update."""
    return state.params.bytes if plan.pp > 1 and plan.pp_schedule == "2bw" else 0


def hpz_held_bytes(state) -> int:
    """ZeRO++ hpZ: between forward and backward every hpZ unit keeps its secondary shard
    (unit bytes / zeropp_hpz) instead of freeing its parameters."""
    return sum(shard * size // hpz for _, size, shard, _, hpz in state.fsdp_units if hpz)


# ---------------------------------------------------------------- peak
def peak_bytes(state, plan, acts: Activations, optimizer="adamw") -> dict:
    """{"forward", "grad_sync", "optimizer_step", "peak"}: bytes alive in each phase."""
    ms = model_state(state, plan, optimizer)
    base = ms["params"].get(DEVICE, 0) + ms["optimizer"].get(DEVICE, 0)
    full_grads = state.params.bytes
    held = sum(ms["grads"].values())  # produced on the device before any move to the host
    forward = base + acts.total + acts.fp8_copies + hpz_held_bytes(state) + stashed_bytes(state, plan) \
        + autocast_copy_bytes(state, plan)
    if acts.microbatches > 1:  # later micro-batches run forward with earlier ones' gradients
        forward += full_grads if plan.zero != 3 else held
    if plan.zero == 3 and state.fsdp_units:
        biggest = int(max(u[1] * u[2] for u in state.fsdp_units) * fsdp_wire_ratio(plan))  # gathered
        forward += (1 + max(1, plan.zero_prefetch)) * biggest  # this unit + those prefetched
        sync = base + held + biggest
    else:
        flat = max((b[5] if plan.zero == 2 else b[3] for b in state.buckets), default=0)
        sync = base + full_grads + flat
    step = base + ms["grads"].get(DEVICE, 0) + (2 * state.largest_param_bytes if plan.offload == "none" else 0)
    if optimizer == "muon" and muon_facts(state, plan) is not None:
        step += muon_facts(state, plan).gathered  # the owner's whole matrices (parallel/muon.py)
    if plan.zero in (1, 2) and state.slices.count:
        step += max(b[3] for b in state.buckets)
    return {"forward": int(forward), "grad_sync": int(sync), "optimizer_step": int(step),
            "peak": int(max(forward, sync, step))}
