"""One layout's prediction: every pipeline stage's memory, communication and FLOPs (one
representative rank per stage: tp/dp/ep peers hold the same amounts), bubble and step time."""
import dataclasses
import functools
from dataclasses import dataclass, field

from ..pipeline.schedules import V_SCHEDULES
from .comm import step_comm
from .flops import model_flops, mtp_flops_per_token, rank_flops
from .hardware import membound_bandwidth
from .memory import (MTP_EXTRA, activations, block_act_elems, first_block_terms,
                     gates_in_experts_saving, micro_seqs,
                     model_state, peak_bytes)
from .rank_state import read_rank_state, with_cp
from .traced_bytes import rank_bytes, step_bytes
from ..pipeline.schedules import bubble_fraction
from .comm import micro_count
from .step_time import (a2a_by_node, a2a_overlap_degree, comm_seconds, expert_gemm_slowdown,
                        exposed_a2a_seconds, fp8_gemm_time, hideable_seconds, host_seconds,
                        node_size, paired_shares, pipeline_pairing, predicted_hidden,
                        stage_breakdown, stage_seconds, wire_bytes)


@dataclass
class StagePrediction:
    rank: int
    model_state: dict          # {"params"|"grads"|"optimizer": {device: bytes}}
    activation_bytes: int      # what the schedule keeps alive (plus loss temporaries)
    activation_per_microbatch: int
    in_flight: int
    memory: dict               # {"forward"|"grad_sync"|"optimizer_step"|"peak": bytes}
    comm_bytes: dict           # {ledger kind: bytes per step} (payload, as the ledger counts)
    wire_bytes: int            # what that puts on the wire (ring/pairwise algorithms)
    flops: float
    comm_s: dict
    step_s: float
    step_s_min: float = 0.0    # lower bound: overlappable communication hidden (step_time.py)
    a2a_nodes: dict = field(default_factory=dict)  # expert_all_to_all_{intra,inter}_node bytes
    a2a_exposed_s: float = 0.0  # the expert all-to-all's seconds not hidden (lower bound)
    membound_bytes: float = 0.0  # non-GEMM bytes of the step (traced_bytes.py), None: not traced
    membound_s: float = 0.0    # those bytes at the HBM bandwidth (in step_s, on the compute stream)
    breakdown_s: dict = field(default_factory=dict)  # step_s by part (step_time.stage_breakdown)
    act_terms: dict = field(default_factory=dict)  # {term: elements per token} of the stage's
    # first MoE block (else its first block), before recomputation (memory.block_act_terms)
    gates_saving: float = 0.0   # elements per token that block keeps less with moe.gates_in_experts


@dataclass
class Prediction:
    plan: object
    stages: list = field(default_factory=list)
    bubble: float = 0.0
    step_s: float = 0.0
    step_s_min: float = 0.0
    tokens_per_s: float = 0.0
    peak_bytes: int = 0
    fits: bool = True
    reason: str = ""
    tflops_per_gpu: float = 0.0  # model FLOPs (flops.model_flops) per GPU per second at step_s
    tokens_per_s_per_gpu: float = 0.0
    flops_per_token: float = 0.0  # model FLOPs of a step / its tokens (Megatron's convention)
    mfu: float = None            # tflops_per_gpu / the hardware's peak; None where unknown
    mtp: dict = field(default_factory=dict)  # model.mtp_depth > 0: mtp_summary's figures

    def rank0(self) -> StagePrediction:
        return self.stages[0]


def stage_ranks(plan) -> list:
    """One rank per pipeline stage: the (dp, tp) = (0, 0) rank of each pp rank."""
    return [s * plan.pool for s in range(plan.pp)]


class StateCache:
    """read_rank_state results by what they depend on (the stage placement, V or looped, but
    not recompute, schedule order or micro-batch count): parallelizing a meta model is the
    planner's slow part."""

    def __init__(self, build_model, workload=None):
        self.build_model, self.states, self.workload = build_model, {}, workload
        self.traced = {}  # (precision, param_dtype) -> traced_bytes.StepBytes (or the error)

    def step_bytes(self, w, precision: str, param_dtype: str = "fp32"):
        """The workload's traced memory-bound bytes (traced_bytes.step_bytes), once per
        precision and parameter dtype; None where the trace cannot run this model (said in
        the report)."""
        key = (precision, param_dtype)
        if key not in self.traced:
            try:
                self.traced[key] = step_bytes(w, precision, param_dtype)
            except Exception as e:  # noqa: BLE001 - a model the fake trace cannot run
                self.traced[key] = e
        got = self.traced[key]
        return None if isinstance(got, Exception) else got

    def get(self, plan, rank):
        zero = 1 if plan.zero in (0, 1, 2) else 3
        hpz = plan.zeropp_hpz  # splits FSDP2 units; offload and quantization are formulas
        v_shape = plan.pp_schedule in V_SCHEDULES  # which stages (blocks, ends) the rank holds
        where, ids = self._place(plan, rank)
        # the replicas' split into dp row streams x cp sequence parts (and the cp mode)
        # changes no tensor, only the cp group (rank_state.with_cp): one read serves them all
        key = (plan.replicas, plan.tp, plan.tp_mode, plan.tp_depth, plan.pp, plan.pp_layers,
               plan.ep, plan.etp, zero, plan.stages_per_rank, v_shape, hpz, where, plan.param_dtype)
        if key not in self.states:
            base = dataclasses.replace(plan, zero=zero, recompute="none", compile=False,
                                       offload="none", zeropp_quantize_weights=False,
                                       zeropp_quantize_grads=False, zeropp_hpz=hpz)
            try:
                build = self.build_model
                if ids is not None and self.workload.build_stage is not None:
                    build = functools.partial(self.workload.build_stage, ids)
                self.states[key] = read_rank_state(build, base, rank)
            except (ValueError, NotImplementedError, TypeError) as e:  # parallelize refused it:
                self.states[key] = e      # so will every plan with this key (schedules, m, ...)
        state = self.states[key]
        if isinstance(state, Exception):
            raise type(state)(*state.args)  # a fresh one: the stored one's traceback stays short
        state = with_cp(state, plan.cp)
        if ids is not None and state.rank != rank:  # a stage of the same shape, read elsewhere
            state = dataclasses.replace(state, rank=rank, block_ids=ids)
        return state

    def _place(self, plan, rank) -> tuple:
        """(what the state depends on of the rank's position, its block ids or None). With
        the workload known, pipeline ranks whose stages hold the same kinds of blocks in the
        same order (dense / MoE) and the same ends share one read: their tensors, buckets
        and units are the same sizes, only the block ids differ."""
        if self.workload is None or plan.pp == 1:
            return rank, None
        from ..pipeline.layers import stage_blocks
        w = self.workload
        layers = stage_blocks(plan.pp_layers, w.model_cfg.n_layers, plan.num_stages)
        stages = plan.stages_of(rank // plan.pool)
        kinds = tuple(tuple(w.is_moe_block(i) for i in layers[st]) for st in stages)
        where = (kinds, 0 in stages, plan.num_stages - 1 in stages, rank % plan.pool)
        return where, sorted(i for st in stages for i in layers[st])


def _gb(nbytes: int, limit: int) -> str:
    """nbytes in GB with enough digits to show it above `limit` (80.00 would hide why)."""
    for digits in range(2, 10):
        text = f"{nbytes / 1e9:.{digits}f}"
        if float(text) * 1e9 > limit:
            return text
    return f"{nbytes / 1e9:.9f}"


def mtp_summary(w, plan, costs) -> dict:
    """What the multi-token prediction depths cost ({} without them): depths, parameters,
    model FLOPs per token, and per token of the last stage, the elements each depth saves
    for backward before recomputation (its block's, what lies around it, its logits)."""
    ids = w.mtp_block_ids()
    if not ids:
        return {}
    m = w.model_cfg
    saved = block_act_elems(w, ids[0], "decoder", plan) + MTP_EXTRA * m.d_model + m.vocab_size
    return {"depths": len(ids), "params": costs.mtp_params,
            "flops_per_token": mtp_flops_per_token(costs, w), "saved_elems_per_token": saved}


def predict(w, plan, hw, costs, cache: StateCache) -> Prediction:
    """Predict a validated plan; raises what parallelize raises for a layout it cannot build."""
    out = Prediction(plan, bubble=bubble_fraction(plan.pp_schedule, plan.pp, plan.microbatches,
                                                   plan.stages_per_rank))
    d, m = a2a_overlap_degree(w), micro_count(w, plan)
    paired = paired_shares(plan, m)
    slowdown, fp8 = expert_gemm_slowdown(w, plan, hw), fp8_gemm_time(plan, hw, w)
    for stage, rank in enumerate(stage_ranks(plan)):
        state = cache.get(plan, rank)
        acts = activations(w, plan, state, stage)
        comm, events = step_comm(w, plan, state, node_size(plan, hw))
        flops = rank_flops(costs, w, plan, state)
        timed = rank_flops(costs, w, plan, state, slowdown, fp8) if slowdown > 1 or fp8 != 1 else flops
        comm_s = comm_seconds(events, plan, rank, hw)
        if plan.offload != "none":
            comm_s["host_offload"] = host_seconds(plan, state, m, hw)
        hidden = hideable_seconds(comm_s, plan, d, paired[stage])
        sb = cache.step_bytes(w, plan.precision, plan.param_dtype) if hw.hbm_tbs else None  # priced where known
        membound = rank_bytes(sb, w, plan, state, micro_seqs(w, plan), m) if sb else None
        membound_s = membound / membound_bandwidth(hw, plan.compiled) if membound else 0.0
        timed += membound_s * hw.tflops * 1e12  # memory-bound kernels hold the compute stream
        breakdown = stage_breakdown(timed, membound_s, comm_s, out.bubble, hw,
                                    predicted_hidden(hidden, plan),
                                    pipeline_pairing(plan, m, timed, comm_s, hw,
                                                     sum(map(w.is_moe_block, state.block_ids))))
        step_s = sum(breakdown.values())  # stage_seconds, by part
        terms = first_block_terms(w, plan, state)
        out.stages.append(StagePrediction(
            rank, model_state(state, plan, w.optimizer), acts.total, acts.per_microbatch,
            acts.in_flight, peak_bytes(state, plan, acts, w.optimizer), comm, wire_bytes(events),
            flops, comm_s, step_s,
            # the bound never above the prediction (a simulated pairing may gain more)
            min(step_s, stage_seconds(timed, comm_s, out.bubble, hw, hidden)),
            a2a_by_node(events), exposed_a2a_seconds(timed, comm_s, hw, hidden),
            membound, membound_s, breakdown,
            terms, gates_in_experts_saving(w, plan, state, terms)))
    out.step_s = max(s.step_s for s in out.stages)
    out.step_s_min = max(s.step_s_min for s in out.stages)
    tokens = w.batch_size * sum(w.stream_tokens.values())
    out.tokens_per_s = tokens / out.step_s if out.step_s > 0 else float("inf")
    out.tokens_per_s_per_gpu = out.tokens_per_s / plan.world
    flops = model_flops(costs, w)
    out.flops_per_token = flops / tokens if tokens else 0.0
    if out.step_s > 0:
        out.tflops_per_gpu = flops / plan.world / out.step_s / 1e12
        out.mfu = out.tflops_per_gpu / hw.peak_tflops if hw.peak_tflops else None
    out.mtp = mtp_summary(w, plan, costs)
    out.peak_bytes = max(s.memory["peak"] for s in out.stages)
    if out.peak_bytes > hw.gpu_mem_bytes:
        worst = max(out.stages, key=lambda s: s.memory["peak"])
        out.fits = False
        out.reason = (f"peak {_gb(out.peak_bytes, hw.gpu_mem_bytes)} GB on rank {worst.rank} > "
                      f"--gpu-mem {hw.gpu_mem_gb:g} GB")
    return out
