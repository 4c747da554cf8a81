"""Step time from FLOPs and bandwidths: an upper bound (nothing overlaps) and a lower bound
(what this toolkit overlaps hides perfectly behind compute).

  t_compute  = rank FLOPs / (--flops, the achievable dense TFLOP/s of one GPU), the expert
               GEMMs' FLOPs stretched by expert_gemm_slowdown where their per-expert shape
               runs below the preset's GEMM efficiency (hardware.gemm_efficiency), the
               blocks' GEMMs under precision=fp8 shrunk by fp8_gemm_time (the FP8 rate)
  t_x        = the calls of collective x, each at hardware.call_seconds: its share of the
               wire bytes / bandwidth of its group, where a group within one node
               (--gpus-per-node consecutive ranks) uses --intra-bw and any other --inter-bw
               (GB/s per GPU), plus the call's latency by NCCL's cost model (so a small
               message runs below the bus bandwidth); wire bytes from the ledger payload
               of a ring/pairwise algorithm on P ranks: all-reduce 2(P-1)/P x, all-gather
               (P-1) x (payload = the shard), reduce-scatter and all-to-all (P-1)/P x,
               send 1 x, tensor-parallel DTensor traffic 1 x; calls counted in comm.py
  t_host     = ZeRO-Offload's host <-> device copies / --host-bw (GB/s, PCIe): offload=
               optimizer moves the held gradient shard/slice down and the updated one up
               (2 x stepped bytes); offload=params also copies every FSDP2 shard up for each
               gather (forward and backward, per micro-batch) and its gradient down. The host
               optimizer step itself is not modelled.
  per stage  = (t_compute + t_tensor_parallel(_row, _col) + t_expert_all_to_all
                + t_expert_tensor_parallel + t_pipeline)
               / (1 - bubble) + t_gradient_sync (dp/ZeRO/FSDP, tied embedding, 2.5d's
               depth sums, other) + t_host
  step time  = the slowest pipeline stage; throughput = global tokens / step time
The micro-batch work is stretched by the pipeline bubble; the data-parallel reductions run
once per step after it. Nothing hidden, that is the upper bound.

The prediction (step_s, used to rank layouts) takes off what moekit's own all-to-all overlap
hides (moe.a2a_overlap_degree > 1, parallel.a2a_overlap=1f1b without a pipeline: the share
below, PAIR_HIDDEN_SHARE of it for the pairs, run beside compute as far as the compute
lasts); inside a pipeline the pairs' effect is the ratio of two simulated schedules, with
and without them (pipeline_pairing: it may be a cost); ZeRO-3's gathers and reduce-scatters
run on FSDP2's own streams beside the compute (FSDP_STREAMS); without either it is the upper
bound. tokens_per_s,
tflops_per_gpu and mfu are at step_s, so the overlap's predicted gain is theirs too.

Lower bound (step_s_min): what runs beside compute in this toolkit may hide behind it --
  expert all-to-all     with moe.a2a_overlap_degree = d > 1, all but 1/d of it (the first
                        dispatch and the last combine of each layer stay exposed); with
                        parallel.a2a_overlap=1f1b the share inside a forward/backward pair:
                        m micro-batches without a pipeline, all but 1/m of it (the first
                        forward's and the last backward's exchanges have no other
                        micro-batch to hide behind; parallel/interleave.py); under a
                        pipeline schedule, pairs_r / (m v) on pipeline rank r (its pairs
                        of m v forwards and m v backwards of its v chunks, the order
                        parallel/pipeline/paired_steps.py runs: warm-up forwards and cool-down
                        backwards stay exposed)
  ZeRO-3 gathers and    FSDP2 issues them on its own streams, the next unit's (or with
  reduce-scatters       parallel.zero_prefetch the next n blocks') while this one computes
  offload host copies   zero 3 + offload=optimizer: the parameter refresh (half the copies)
                        runs on a side stream, each unit waiting only for its own
  stage_min = max(t_compute, hidden) / (1 - bubble) + the exposed rest
Tensor-parallel collectives, pipeline send/recv, ZeRO-0/1/2 gradient reductions (issued
after backward), the gradient-norm all-reduce and offload's gradient copies stay exposed.
The truth on a GPU lies between the two bounds; neither is a measurement.
"""
import dataclasses

from ..mesh import rank_groups
from .hardware import GEMM_EFFICIENCY, Hardware, call_seconds, gemm_efficiency
from .memory import micro_seqs

INSIDE_STEP = {"tensor_parallel", "tensor_parallel_row", "tensor_parallel_col",
               "tensor_parallel_depth", "context_parallel", "expert_all_to_all",
               "expert_tensor_parallel", "pipeline"}
_WIRE = {"reduce": lambda P: 2 * (P - 1) / P, "gather": lambda P: P - 1,
         "scatter": lambda P: (P - 1) / P, "a2a": lambda P: (P - 1) / P, "p2p": lambda P: 1.0,
         "across": lambda P: 1.0}   # an all-to-all's bytes to other nodes (expert_nodes.py)
# the expert all-to-all's parts (expert_nodes.py): inside this rank's node, to other nodes
_LINKS = {"ep@intra": "intra", "ep@inter": "inter"}
# What a 1F1B pair's overlap takes off the step, as a share of the expert all-to-all it
# could hide: measured on Megatron-Core's implementation of the same schedule (a forward and
# a backward micro-batch interleaved layer by layer, each one's exchanges beside the other's
# compute): Megatron-Bridge's Qwen3-30B-A3B card, 16 H100, EP16, HybridEP, an Nsight profile
# of 8.25 s of communication a step with the overlap off (9.079 ms = 0.11% of it concurrent
# with compute), step 24.71 s -> 20.99 s with it on: 3.72 s / 8.25 s = 0.45. The exchanges
# run 31% longer beside compute (10.83 s) and only 36.55% of them find compute to run beside.
# moekit's own pairs (parallel/interleave.py) are not measured on a GPU yet: this is the
# evidence there is; the lower bound (step_s_min) still hides them whole.
PAIR_HIDDEN_SHARE = 0.45
# ZeRO-3's collectives, which FSDP2 runs on streams of its own: each unit's all-gather issued
# ahead of its compute (the next block's, or parallel.zero_prefetch's n blocks'; backward
# prefetches the previous one), the gradients' reduce-scatter after it, both beside the
# compute. Evidence: Megatron-MoE-ModelZoo's Qwen3-235B-A22B TP2 EP8 FSDP row on 256 H100,
# 17.6 s a step, predicted 17.5 s with them hidden and 30.5 s with them exposed
# (bench/planner_calibration.py). moekit's own FSDP2 beside expert parallelism, whose split
# sizes the host reads each layer (so it issues the next gather only once it has them), is
# not measured on a GPU yet.
FSDP_STREAMS = ("zero_param_gather", "zero_grad_reduce_scatter")


def _link(groups: dict, rank: int, dim: str, hw: Hardware, node_size: int) -> tuple:
    """(bandwidth in bytes/s, nodes the group spans) of `rank`'s group on dim."""
    if dim in _LINKS:
        inside = _LINKS[dim] == "intra"
        return (hw.intra_bw_gbs if inside else hw.inter_bw_gbs) * 1e9, 1 if inside else 2
    ranks = next((g for g in groups.get(dim, [[rank]]) if rank in g), [rank])
    nodes = len({r // node_size for r in ranks})
    return (hw.intra_bw_gbs if nodes == 1 else hw.inter_bw_gbs) * 1e9, nodes


def node_size(plan, hw: Hardware) -> int:
    """Global ranks per node: parallel.gpus_per_node where the plan sets it, else the
    hardware's --gpus-per-node."""
    return plan.gpus_per_node or hw.gpus_per_node


def a2a_by_node(events) -> dict:
    """{expert_all_to_all_intra_node, expert_all_to_all_inter_node: bytes} of the events."""
    out = {f"expert_all_to_all_{side}_node": 0 for side in ("intra", "inter")}
    for kind, _, dim, _, n, _ in events:
        if dim in _LINKS:
            out[f"{kind}_{_LINKS[dim]}_node"] += n
    return out if any(out.values()) else {}


def wire_bytes(events) -> int:
    """Bytes a rank puts on the wire for its events (the algorithm factors above)."""
    return int(sum(n * _WIRE.get(c, lambda P: 1.0)(size) for _, c, _, size, n, _ in events))


def comm_seconds(events, plan, rank: int, hw: Hardware) -> dict:
    """{kind: seconds} of this rank's events."""
    out, groups = {}, rank_groups(plan) if events else {}
    for kind, collective, dim, size, nbytes, calls in events:
        wire = nbytes * _WIRE.get(collective, lambda P: 1.0)(size)
        bandwidth, nodes = _link(groups, rank, dim, hw, node_size(plan, hw))
        seconds = calls * call_seconds(collective, size, nodes, wire / calls, bandwidth) \
            if calls else wire / bandwidth
        out[kind] = out.get(kind, 0.0) + seconds
    return out


def exposed_a2a_seconds(flops: float, comm_s: dict, hw: Hardware, hidden: dict) -> float:
    """The expert all-to-all's seconds left exposed in the lower bound: what is hideable
    hides only as far as the compute lasts (stage_seconds' max), shared in proportion."""
    total = comm_s.get("expert_all_to_all", 0.0)
    can = sum(hidden.values())
    if not total or not can:
        return total
    t_compute = flops / (hw.tflops * 1e12)
    return total - hidden.get("expert_all_to_all", 0.0) * min(1.0, t_compute / can)


def stage_seconds(flops: float, comm_s: dict, bubble: float, hw: Hardware, hidden=None,
                  pipelined: float = 1.0) -> float:
    """One stage's step time; hidden ({kind: seconds}, hideable_seconds) run under compute:
    none for the upper bound, hideable_seconds for the lower one. pipelined: what scales
    the micro-batch work stretched by the bubble (pipeline_pairing): the sum of its parts,
    stage_breakdown."""
    return sum(stage_breakdown(flops, 0.0, comm_s, bubble, hw, hidden, pipelined).values())


def stage_breakdown(flops: float, membound_s: float, comm_s: dict, bubble: float, hw: Hardware,
                    hidden=None, pipelined: float = 1.0) -> dict:
    """One stage's step time (stage_seconds' arguments, and the memory-bound seconds inside
    `flops`) by what the stage spends it on; the step is (work of the micro-batches, the
    compute or the traffic hidden under it, whichever is longer, plus the exposed in-step
    traffic) / (1 - bubble) x pipelined + the exposed traffic after them, in parts:
      gemm, memory_bound    the compute stream: GEMMs by shape, the traced non-GEMM bytes
      overlap_excess        hidden traffic that outlasts the compute it hides behind
      <inside kinds>        exposed communication inside the micro-batch work
      bubble                the pipeline bubble's stretch of all of the above
      pp_pairing            the 1f1b pairs' simulated effect on it (negative: a gain)
      <after kinds>         exposed communication after the micro-batches (dp/ZeRO, host)"""
    hidden = hidden or {}
    exposed = {k: v - hidden.get(k, 0.0) for k, v in comm_s.items()}
    t_compute = flops / (hw.tflops * 1e12)
    out = {"gemm": t_compute - membound_s, "memory_bound": membound_s,
           "overlap_excess": max(t_compute, sum(hidden.values())) - t_compute}
    out.update((k, v) for k, v in sorted(exposed.items()) if k in INSIDE_STEP)
    work = sum(out.values())
    out["bubble"] = work * (1.0 / (1.0 - bubble) - 1.0)
    out["pp_pairing"] = work / (1.0 - bubble) * (pipelined - 1.0)
    out.update((k, v) for k, v in sorted(exposed.items()) if k not in INSIDE_STEP)
    return {k: v for k, v in out.items() if v}


# where each part of stage_breakdown comes from, and which are guesses (`--layout` prints it)
TERM_EVIDENCE = {
    "gemm": "FLOPs at the preset's peak x 0.70 (bench/gemm_efficiency.py, H200: 8192^3 bf16 "
            "at 77%), expert GEMMs by their per-expert shape (hardware.gemm_efficiency)",
    "memory_bound": "non-GEMM bytes traced from the model's own ops (traced_bytes.py, equal to "
                    "the op census; RMSNorm and MLA's attention as CUDA's fused kernels) at "
                    "0.43 (eager) / 0.73 (compiled) of the data-sheet HBM bandwidth, measured "
                    "with moekit's step on an H200 (hardware.py; 1 GPU, not a cluster)",
    "overlap_excess": "the overlapped traffic's seconds beyond the compute they hide behind",
    "tensor_parallel": "NCCL's ring cost model (tuning.cc) at nccl-tests' bus bandwidths "
                       "(nccl-tests#212, #290), calls and bytes from the ledger; never overlapped",
    "context_parallel": "as tensor_parallel (ring attention's K/V sends); never overlapped",
    "expert_all_to_all": "one pairwise step at the bus bandwidth (NVLink; one NIC per GPU across "
                         "nodes, nccl-tests#267) with NCCL's latency model; a guess for the "
                         "all-to-all's efficiency by message size (no measured curve); "
                         "parallel.a2a_overlap=1f1b takes 0.45 of it off (Megatron-Core's pairs "
                         "measured, Megatron-Bridge's Qwen3-30B-A3B profile; moekit's not yet)",
    "expert_tensor_parallel": "as tensor_parallel",
    "pipeline": "send/recv at the link's bus bandwidth; not overlapped with compute (a guess: "
                "Megatron overlaps its p2p)",
    "bubble": "the schedule's bubble fraction (parallel/pipeline/schedules.py) for stages of "
              "equal cost; a guess where the first and last stages differ",
    "pp_pairing": "the 1f1b pairs simulated at this stage's costs (parallel/pipeline/simulate.py)",
    "dp_grad_reduce": "ring all-reduce after the last backward (moekit does not overlap it)",
    "zero_param_gather": "ring all-gather: ZeRO-1/2's of the updated slices, after the step, "
                         "exposed; ZeRO-3's on FSDP2's stream, hidden behind compute as far as it "
                         "lasts (a published FSDP run measured at it; moekit's FSDP2 beside ep "
                         "not measured on a GPU: step_time.FSDP_STREAMS)",
    "zero_grad_reduce_scatter": "ring reduce-scatter: ZeRO-2's after backward, exposed; ZeRO-3's "
                                "on FSDP2's stream, as zero_param_gather",
    "host_offload": "PCIe x16 per direction x 0.80 (a guess)",
    "tied_embedding": "ring all-reduce of the tied embedding's gradient between its stages",
    "muon_orthogonalise": "Muon's gathers and scatters of matrix pieces, NCCL's cost model",
    "other": "small collectives (gradient norm, loss), NCCL's latency model",
}
for _grid in ("tensor_parallel_row", "tensor_parallel_col", "tensor_parallel_depth"):
    TERM_EVIDENCE[_grid] = TERM_EVIDENCE["tensor_parallel"]


def pipeline_pairing(plan, microbatches: int, flops: float, comm_s: dict, hw: Hardware,
                     moe_layers: int) -> float:
    """parallel.a2a_overlap=1f1b under pp > 1: the step of the schedule with the overlap's
    pairs over the one without, both simulated (parallel/pipeline/simulate.py) at this
    stage's costs: per micro-batch-chunk a forward of 1/3 and a backward of 2/3 of its
    compute and other in-step traffic, half of its expert all-to-all each, in moe_layers
    exchanges. Below 1 the pairs gain; above 1 they cost (a pair's forward ends after the
    backward's interleaved pieces, which its neighbour waits for). 1.0 without the pairs.
    The pairs hide PAIR_HIDDEN_SHARE of the all-to-all at most: the rest runs exposed in
    both schedules, as compute would."""
    if plan.a2a_overlap != "1f1b" or plan.pp == 1 or microbatches < 2:
        return 1.0
    from ..pipeline.simulate import StepCost, simulate
    chunks = microbatches * plan.stages_per_rank
    a2a = comm_s.get("expert_all_to_all", 0.0)
    work = flops / (hw.tflops * 1e12) + sum(v for k, v in comm_s.items()
                                            if k in INSIDE_STEP and k != "expert_all_to_all")
    if not a2a or not work:
        return 1.0
    exposed, hideable = a2a * (1 - PAIR_HIDDEN_SHARE), a2a * PAIR_HIDDEN_SHARE
    work += exposed
    cost = StepCost(f=work / 3 / chunks, b=2 * work / 3 / chunks, a_f=hideable / 2 / chunks,
                    a_b=hideable / 2 / chunks, layers=max(1, round(moe_layers / plan.stages_per_rank)))
    args = (plan.pp_schedule, plan.pp, microbatches, plan.stages_per_rank)
    ratio = simulate(*args, dataclasses.replace(cost, paired=True)) / simulate(*args, cost)
    return max(ratio, work / (work + hideable))  # at best as if the hideable part were gone


def paired_shares(plan, microbatches: int) -> list:
    """[share of pipeline rank r's forwards and backwards that run inside a pair] under
    parallel.a2a_overlap=1f1b (see the lower bound above); zeros without it."""
    if plan.a2a_overlap != "1f1b" or microbatches < 2:
        return [0.0] * plan.pp
    if plan.pp == 1:
        return [1 - 1 / microbatches]
    from ..pipeline.paired_steps import paired_counts
    counts = paired_counts(plan.pp_schedule, plan.pp, microbatches, plan.stages_per_rank)
    return [c / (microbatches * plan.stages_per_rank) for c in counts or [0] * plan.pp]


def a2a_overlap_degree(w) -> int:
    """moe.a2a_overlap_degree of the workload (1 without MoE layers)."""
    return getattr(w.moe_cfg, "a2a_overlap_degree", 1) if w.has_moe() else 1


def a2a_overlapped(w, plan) -> bool:
    """Whether the layout overlaps the expert all-to-all with compute (moe.a2a_overlap_degree
    > 1 or parallel.a2a_overlap=1f1b): the prediction then hides its hideable share."""
    return a2a_overlap_degree(w) > 1 or plan.a2a_overlap == "1f1b"


def predicted_hidden(hidden: dict, plan) -> dict:
    """What the prediction (step_s) hides of the lower bound's hideable seconds: the expert
    all-to-all's share that moekit's own overlap runs beside compute (moe.a2a_overlap_degree;
    parallel.a2a_overlap=1f1b without a pipeline, PAIR_HIDDEN_SHARE of it; a pipeline's pairs
    are priced by simulation instead: pipeline_pairing) and ZeRO-3's gathers and
    reduce-scatters (FSDP_STREAMS); offload's copies stay in the bound only."""
    out = {k: v for k, v in hidden.items() if k in FSDP_STREAMS}
    if "expert_all_to_all" in hidden and not (plan.pp > 1 and plan.a2a_overlap == "1f1b"):
        share = PAIR_HIDDEN_SHARE if plan.a2a_overlap == "1f1b" else 1.0
        out["expert_all_to_all"] = hidden["expert_all_to_all"] * share
    return out


def hideable_seconds(comm_s: dict, plan, overlap_degree: int, paired: float = 0.0) -> dict:
    """{kind: seconds of it that can run under compute} (see the lower bound above);
    paired: this rank's paired_shares entry."""
    out = {}
    if overlap_degree > 1 and "expert_all_to_all" in comm_s:
        out["expert_all_to_all"] = comm_s["expert_all_to_all"] * (1 - 1 / overlap_degree)
    if paired and "expert_all_to_all" in comm_s:
        out["expert_all_to_all"] = comm_s["expert_all_to_all"] * paired
    if plan.zero == 3:
        for kind in ("zero_param_gather", "zero_grad_reduce_scatter"):
            if kind in comm_s:
                out[kind] = comm_s[kind]
        if plan.offload == "optimizer" and "host_offload" in comm_s:
            out["host_offload"] = comm_s["host_offload"] / 2
    return out


def host_seconds(plan, state, microbatches: int, hw: Hardware) -> float:
    """ZeRO-Offload's copies between host and device per step (see t_host above)."""
    if plan.offload == "none":
        return 0.0
    stepped = state.slices.bytes if plan.zero in (1, 2) and state.slices.count else state.params.bytes
    nbytes = 2 * stepped
    if plan.offload == "params":
        nbytes = state.params.bytes * (2 * microbatches + 1)
    return nbytes / (hw.host_bw_gbs * 1e9)


def expert_rows(w, plan) -> float:
    """Rows one local expert receives per micro-batch (the m of its GEMMs): this rank's
    tokens x top_k spread over the experts, from the ep x etp ranks that send to it (etp
    gathers its group's rows), times the stated routing imbalance."""
    moe = w.moe_cfg
    tokens = micro_seqs(w, plan) * w.stream_tokens.get("decoder", 0) / (plan.cp * plan.tp)
    imbalance = w.imbalance if plan.ep > 1 else 1.0
    return tokens * moe.top_k * plan.ep * plan.etp / moe.num_experts * imbalance


def fp8_gemm_time(plan, hw: Hardware, w=None) -> float:
    """precision=fp8: the blocks' GEMMs' time at the FP8 rate over their time at the bf16 one;
    1 otherwise or where the preset has no FP8 GEMMs. fp8_recipe=rowwise with the workload
    `w`: what the runtime runs (parallel/fp8.py) -- each GEMM whose shape cannot gain stays
    bf16 (moe/fp8_rowwise.py rowwise_pays), the others at the rowwise kernel's measured speed
    over bf16 (fp8_speedup), weighted by their FLOPs a token; else hw's FP8 rate over its
    bf16 one (hardware.py "FP8 GEMMs": DeepGEMM's blockwise kernel)."""
    if plan.precision != "fp8" or not hw.fp8_tflops:
        return 1.0
    if plan.fp8_recipe != "rowwise" or w is None:
        return hw.tflops / hw.fp8_tflops
    from moe.fp8_rowwise import fp8_speedup, rowwise_pays
    compiled = plan.compiled
    tokens = micro_seqs(w, plan) * w.stream_tokens.get("decoder", 0) / plan.cp
    flops = timed = 0.0
    for K, N, per_token, rows in _block_gemms(w, tokens):
        f = 2 * K * N * per_token
        fp8 = rowwise_pays(K, N, rows, compiled)[0]
        flops += f
        # forward (contraction K) and dgrad (N) in FP8, wgrad in bf16: 3 GEMMs of equal FLOPs
        timed += f * ((1 / fp8_speedup(K) + 1 / fp8_speedup(N) + 1) / 3 if fp8 else 1.0)
    return timed / flops if flops else 1.0


def _block_gemms(w, tokens: float) -> list:
    """(K, N, GEMMs of that shape a token runs on average over the blocks, rows a weight sees a
    micro-batch) for the blocks' attention projections and FFN/expert projections."""
    m, moe = w.model_cfg, w.moe_cfg
    D, H = m.d_model, m.n_heads
    hd = m.head_dim or D // H
    kv = (m.n_kv_heads or H) * hd
    ffn_mats = 3 if w.gated else 2
    n = m.n_layers
    moe_frac = sum(w.is_moe_block(i) for i in range(n)) / n if w.has_moe() else 0.0
    out = [(D, H * hd, 1, tokens), (H * hd, D, 1, tokens), (D, kv, 2, tokens)]
    if moe_frac < 1:
        out.append((D, m.d_ff, (ffn_mats - 1) * (1 - moe_frac), tokens))
        out.append((m.d_ff, D, 1 - moe_frac, tokens))
    if moe_frac:
        F, k, E = w.expert_d_ff, moe.top_k, moe.num_experts
        rows = tokens * k / E
        out.append((D, F, (ffn_mats - 1) * k * moe_frac, rows))
        out.append((F, D, k * moe_frac, rows))
    return [g for g in out if g[2] > 0]


def expert_gemm_slowdown(w, plan, hw: Hardware) -> float:
    """Time of the routed experts' GEMMs at their shape over their time at the preset's
    GEMM_EFFICIENCY (>= 1; 1 where the peak is unknown: the measured shares are of the peak).
    Up-projections [m, D] x [D, F/etp] (two when gated), the down-projection [m, F/etp] x
    [F/etp, D]; backward's GEMMs share their forward's shape class."""
    if not w.has_moe() or not hw.peak_tflops:
        return 1.0
    m, D, F = expert_rows(w, plan), w.model_cfg.d_model, w.expert_d_ff / plan.etp
    ups = 2 if w.gated else 1
    slow = [max(1.0, GEMM_EFFICIENCY / gemm_efficiency(m, D, F, hw))] * ups + \
        [max(1.0, GEMM_EFFICIENCY / gemm_efficiency(m, F, D, hw))]
    return sum(slow) / len(slow)
