"""The layout search for large worlds: best-first over lower bounds, exact predictions only
for layouts that can still make the top list.

The exhaustive search (report.plan_all) predicts every candidate of enumerate.py; at world
1024 there are tens of millions. Here candidates are grouped by structure (dp, cp, tp and its
form, pp, ep, etp), then by pipeline schedule and micro-batches; every layout of a group runs
at least the group's bound

    bound = (C + A_in) / (1 - bubble) + A_out + G   (seconds; <= the predicted step_s)
    C = the sum of all ranks' training FLOPs without recomputation (flops.model_flops with the
        routing imbalance under ep) / world / achievable FLOP/s: the mean stage's compute
        (under precision=fp8 all of it at the FP8 rate: step_time.fp8_gemm_time)
    A = the mean stage's traffic (structure_seconds: comm.py's expert all-to-all, expert-
        tensor, tensor- and context-parallel payloads of the whole model with recompute off,
        over pp; the all-to-all left out under an all-to-all overlap) on the wire, at the
        intra-node bandwidth where the group can lie in one node's consecutive ranks
        ((size-1) stride + 1 <= gpus per node), else inter; A_in
        the part step_time surely stretches by the bubble (inside_seconds), A_out the rest
    bubble = the group's schedule bubble (structures: the smallest of their schedules')
    G = sync_seconds x _sync_factor: the least gradient synchronisation any of the
        structure's ZeRO settings does (at one micro-batch), run after the pipeline

The slowest stage is at least the mean stage, and ZeRO, offload, recomputation, tensor and
data-parallel traffic only add, so no layout beats its bound. A group's own bound and each
layout's (variant_bound) are tighter: every stage's compute from its real blocks
(flops.rank_flops; the bubble stretches it), plus its expert all-to-all, expert-tensor,
pipeline send/recv, tensor- and context-parallel traffic (comm.py's own terms, from the
stage's blocks), and for the mean stage plus the gradient synchronisation of the layout's
ZeRO setting (the group: of its cheapest). Memory: a layout cannot fit when one stage's
forward end (its activations, memory.activations, exact, on top of the parameters and
optimizer state surely on it, earlier micro-batches' gradients and ZeRO-3's gathered
units: memory_bound) or the mean stage's model state exceeds the GPU; a group whose
leanest layout (the highest ZeRO stage, deepest offload, recomputation) cannot fit is
dropped whole. A group refused by validate for a reason that names no ZeRO / offload /
recompute setting is refused whole (its layouts counted under that reason). Structures,
groups and layouts share one heap, smallest bound first (a group's layouts join it each at
its own bound, so a slow ZeRO variant waits behind faster layouts of other groups); the
search stops when the next bound exceeds the top-th fitting step time: the top list (and
its order) is the exhaustive search's (tests/unit/test_planner_search.py checks it at
world 8 and 16). Layouts never reached are counted, not listed.

Reads: StateCache shares one meta parallelize among the pipeline ranks of one stage shape
and among the splits of a stage's dp x cp replicas (rank_state.with_cp).
"""
import bisect
import collections
import dataclasses
import heapq
import itertools

from ..pipeline.schedules import MULTI_STAGE_SCHEDULES, bubble_fraction
from .enumerate import pipelines, rejection, structures, variants, with_default_layers
from .flops import model_flops
from .hardware import membound_bandwidth
from .predict import predict
from .report import BUILD_ERRORS, rank_key
from .step_time import expert_gemm_slowdown, fp8_gemm_time
from .traced_bytes import token_bytes

SLACK = 1 - 1e-9  # bounds and predictions add the same terms in another order


def _bubble(pp, schedule, m) -> float:
    chunks = 2 if schedule in MULTI_STAGE_SCHEDULES else 1  # pp_stages_per_rank=0 (auto)
    return bubble_fraction(schedule, pp, m, chunks)


def structure_seconds(w, base, s: dict, hw) -> tuple:
    """A of the module docstring for structure s, as inside_seconds' (stretched, rest): its
    terms for the whole model (every
    block on one stage, both ends, recomputation off) over pp, without the pipeline's own
    send/recv (which depends on the schedule). The terms are additive over blocks, so this is
    the mean stage's; micro_seqs x micro_count is the local batch whatever m is taken."""
    if w.batch_size < s["dp"]:  # no sequence per rank: validate refuses it when expanded
        return 0.0, 0.0
    sch, m = pipelines(s["pp"])[0]
    plan = dataclasses.replace(base, **s, pp_schedule=sch, microbatches=m, pp_stages_per_rank=0,
                               recompute="none")
    whole = _Blocks(list(range(w.model_cfg.n_layers)), True)
    return tuple(t / s["pp"] for t in inside_seconds(w, plan, whole, hw, pipeline=False))


def structure_bound(w, base, s: dict, hw, sizes, compute_s: float, zero_variants) -> float:
    """The bound of the module docstring for structure s: compute_s = C, zero_variants: its
    ZeRO variants (enumerate.variants), sizes: state_bytes of the whole model."""
    least = min(_bubble(s["pp"], sch, m) for sch, m in pipelines(s["pp"]))
    stretched, rest = structure_seconds(w, base, s, hw)
    x = (compute_s + stretched) / (1 - least) + rest
    out = []
    for group, hidden in _by_hiding(zero_variants):
        sync = sum(t * f for t, f in zip(sync_seconds(s, sizes, hw), _least_factors(group, 1)))
        out.append(max(x, sync) if hidden else x + sync)
    return min(out)


def _by_hiding(zero_variants) -> list:
    """[(variants, hidden)]: the ZeRO-3 variants, whose collectives run beside the compute
    (step_time.FSDP_STREAMS: a bound takes the longer of the two, not their sum), and the
    rest; only the non-empty groups."""
    z3 = [v for v in zero_variants if v["zero"] == 3]
    rest = [v for v in zero_variants if v["zero"] != 3]
    return [(g, hidden) for g, hidden in ((z3, True), (rest, False)) if g]


def _inside_node(size: int, stride: int, hw) -> bool:
    """A group of `size` ranks `stride` apart can lie in one node (else it surely spans two)."""
    return (size - 1) * stride + 1 <= hw.gpus_per_node


def state_bytes(model) -> tuple:
    """(dense, expert) parameter bytes of the whole single-device model (tied weights once)."""
    from ..kinds import is_expert_param
    dense = expert = 0
    for name, p in model.named_parameters():
        if is_expert_param(name):
            expert += p.numel() * p.element_size()
        else:
            dense += p.numel() * p.element_size()
    return dense, expert


def sync_seconds(s: dict, sizes: tuple, hw, stages_over: int = None) -> tuple:
    """(dense, expert): the least gradient-synchronisation seconds of any ZeRO setting: each
    replica group moves at least (P-1)/P of its mean stage's gradient bytes once (an
    all-reduce moves twice that, ZeRO-1/2 gather the slices back, ZeRO-3 gathers the
    parameters each micro-batch; only ZeRO++'s quantized reduce-scatter moves less, and its
    all-gather still moves this much). Dense gradients: dense bytes / (tp pp) over the
    dp x cp replicas (tp ranks apart); expert gradients: expert bytes / (ep etp pp) over
    edp = dp cp tp / (ep etp) ranks. stages_over: what divides `sizes` instead of pp (1:
    they are one stage's)."""
    dense, expert = sizes
    pp = s["pp"] if stages_over is None else stages_over
    out = [0.0, 0.0]
    P = s["dp"] * s["cp"]
    if P > 1:
        bw = hw.intra_bw_gbs if _inside_node(P, s["tp"], hw) else hw.inter_bw_gbs
        out[0] = dense / (s["tp"] * pp) * (P - 1) / P / (bw * 1e9)
    E = s["dp"] * s["cp"] * s["tp"] // (s["ep"] * s["etp"])
    if E > 1 and expert:
        bw = hw.intra_bw_gbs if _inside_node(E, s["ep"] * s["etp"], hw) else hw.inter_bw_gbs
        out[1] = expert / (s["ep"] * s["etp"] * pp) * (E - 1) / E / (bw * 1e9)
    return tuple(out)


@dataclasses.dataclass
class _Blocks:
    """What memory.activations and comm.py's pipeline and tensor-parallel terms read of a
    rank state: its blocks, its ends, its rank (the first of its pipeline rank)."""
    block_ids: list
    last_stage: bool
    first_stage: bool = True
    rank: int = 0
    replicated_tp_bytes: int = 0   # left out: the bound stays below the prediction
    grid_grad_sums: dict = dataclasses.field(default_factory=dict)  # left out, likewise


def _state_parts(plan, sizes, optimizer: str) -> tuple:
    """(params + optimizer state, gradients): the least GPU bytes of each on a stage holding
    `sizes` = (dense, expert) bytes of the whole model's parameters: memory.py's model with
    bytes / tp dense over the dp x cp replicas and / (ep etp) expert over edp, AdamW's 2
    moments (Adafactor: 0; Muon: 1, its matrices' momentum, a bound for its AdamW rest), ZeRO-1/2's fp32 master slices, offload's moves to the host."""
    dense, expert = sizes
    persist = grads_total = 0.0
    for x, n in ((dense / plan.tp, plan.replicas), (expert / (plan.ep * plan.etp), plan.edp)):
        moments = {"adafactor": 0.0, "muon": x}.get(optimizer, 2 * x)  # muon: one buffer at least
        params, grads, opt = {0: (x, x, moments), 1: (x, x, (x + moments) / n),
                              2: (x, x / n, (x + moments) / n),
                              3: (x / n, x / n, moments / n)}[plan.zero]
        if plan.offload != "none":
            opt = 0.0
            if plan.zero in (2, 3) or plan.offload == "params":
                grads = 0.0
            if plan.offload == "params":
                params = 0.0
        persist += params + opt
        grads_total += grads
    return persist, grads_total


def _state_gb_bound(plan, sizes, optimizer: str) -> float:
    """The least GPU bytes of params + gradients + optimizer state of the mean stage (the
    optimizer-step phase holds all three)."""
    persist, grads = _state_parts(plan, (sizes[0] / plan.pp, sizes[1] / plan.pp), optimizer)
    return persist + grads


def _block_bytes(w) -> tuple:
    """([dense bytes], [expert bytes]) per block and the embedding's and an untied head's
    bytes: only what surely exists (pipeline/layers.py's block_weights: the matmul weights,
    no norms, no biases), fp32 parameters, the whole model's (not divided by any degree)."""
    from ..pipeline.layers import block_weights
    m, moe = w.model_cfg, (w.moe_cfg if w.has_moe() else None)
    _t, params, embed, (_ht, head) = block_weights(m, moe, w.stream_tokens.get("decoder", 0))
    expert = [0] * len(params)
    if moe is not None:
        from moe.experts import ACTIVATIONS
        g = 3 if ACTIVATIONS.get(m.activation, (None, False))[1] else 2
        bank = moe.num_experts * g * m.d_model * (moe.d_ff or m.d_ff)
        expert = [bank if w.is_moe_block(i) else 0 for i in range(len(params))]
    return [4 * (p - e) for p, e in zip(params, expert)], [4 * e for e in expert], 4 * embed, 4 * head


def _stage_sizes(blocks, stages) -> list:
    """[(dense, expert) bytes] per pipeline rank, counting only what surely lies there
    (blocks = _block_bytes): its blocks, the embedding on the first stage, an untied head on
    the last."""
    dense, expert, embed, head = blocks
    return [(sum(dense[i] for i in st.block_ids) + (embed if st.first_stage else 0) +
             (head if st.last_stage else 0), sum(expert[i] for i in st.block_ids))
            for st in stages]


def _gathered_unit(blocks, plan, st) -> float:
    """ZeRO-3: the least bytes of the stage's largest gathered FSDP2 unit (memory.py's
    'biggest'): a MoE layer's expert bank over ep x etp (one unit: fsdp.py wraps the
    experts module), and without hpZ (which may give a block's other-dim parameters units
    of their own) a dense block's weights over tp. blocks: _block_bytes."""
    dense, expert, _e, _h = blocks
    out = 0.0
    for i in st.block_ids:
        if expert[i]:
            out = max(out, expert[i] / (plan.ep * plan.etp))
        elif not plan.zeropp_hpz:
            out = max(out, dense[i] / plan.tp)
    return out


def memory_bound(w, plan, sizes) -> float:
    """A lower bound of the layout's peak bytes: the mean stage's model state
    (_state_gb_bound), or a stage's forward end, whichever is larger: its activations
    (memory.activations, exact: it needs only the stage's blocks) on top of the params and
    optimizer state surely there (the whole model's with one stage, else _stage_sizes) and,
    with gradient accumulation outside ZeRO-3, the gradients of earlier micro-batches; under
    ZeRO-3 the gathered units (_gathered_unit) this one and the prefetched."""
    from .memory import activations
    stages, blocks = _stage_blocks(w, plan), _block_bytes(w)
    held = [sizes] if plan.pp == 1 else _stage_sizes(blocks, stages)
    worst = 0.0
    for r, (st, stage_sizes) in enumerate(zip(stages, held)):
        acts = activations(w, plan, st, r)
        persist, _grads = _state_parts(plan, stage_sizes, w.optimizer)
        if acts.microbatches > 1 and plan.zero != 3:  # full local gradients
            persist += stage_sizes[0] / plan.tp + stage_sizes[1] / (plan.ep * plan.etp)
        if plan.zero == 3 and plan.world > 1:  # this unit and at least one prefetched
            persist += (1 + max(1, plan.zero_prefetch)) * _gathered_unit(blocks, plan, st)
        worst = max(worst, acts.total + persist)
    return max(worst, _state_gb_bound(plan, sizes, w.optimizer))


def _stage_blocks(w, plan) -> list:
    """[_Blocks] per pipeline rank of a plan whose pp_layers are resolved."""
    if plan.pp == 1:
        return [_Blocks(list(range(w.model_cfg.n_layers)), True)]
    from ..pipeline.layers import stage_blocks
    layers = stage_blocks(plan.pp_layers, w.model_cfg.n_layers, plan.num_stages)
    return [_Blocks(sorted(i for st in plan.stages_of(r) for i in layers[st]),
                    plan.num_stages - 1 in plan.stages_of(r), 0 in plan.stages_of(r), r * plan.pool)
            for r in range(plan.pp)]


def inside_seconds(w, plan, state, hw, pipeline: bool = True) -> tuple:
    """(stretched, rest) seconds of the stage's expert all-to-all and expert-tensor-parallel
    traffic, pipeline send/recv (unless pipeline=False), tensor- and context-parallel
    traffic: comm.py's own terms, at the intra-node bandwidth where the group can lie in one
    node. stretched: what step_time surely stretches by the bubble (the ledger classifies it
    inside the step whatever other dims its group serves: ledger.classify): pipeline
    send/recv, the expert all-to-alls (not under 2.5d, whose depth group may be the ep
    group), tensor-parallel traffic but its reductions; rest: the others (context-parallel
    traffic runs after the stretch). Under an all-to-all overlap (step_time.a2a_overlapped)
    the expert all-to-all is left out: the prediction hides up to all of it."""
    from collections import Counter

    from .comm import _context, _experts, _grid_tensor, _pipeline, _tensor
    from .step_time import _WIRE, a2a_overlapped
    q = plan.tp_grid or 1
    sizes = {"pp": plan.pp, "tp": plan.tp, "ep": plan.ep, "etp": plan.etp, "cp": plan.cp,
             "tpc": q, "tpr": q, "tpd": plan.tp_depth}
    # the tp and etp groups are consecutive ranks, an ep group etp apart, a cp group tp
    # apart (mesh.py); a grid dim's stride is unknown here, so only a group larger than a
    # node surely leaves it
    inside = {"pp": _inside_node(plan.pp, plan.pool, hw), "tp": _inside_node(plan.tp, 1, hw),
              "ep": _inside_node(plan.ep, plan.etp, hw), "etp": _inside_node(plan.etp, 1, hw),
              "cp": _inside_node(plan.cp, plan.tp, hw),
              **{d: sizes[d] <= hw.gpus_per_node for d in ("tpc", "tpr", "tpd")}}
    stretched = {"pp", "tpc", "tpr"} | ({"ep", "etp"} if plan.tp_mode != "2.5d" else set())
    total = [0.0, 0.0]

    def seconds(collective, dim, nbytes):
        P = sizes.get(dim, 1)
        if P <= 1 or not nbytes:
            return 0.0
        bw = hw.intra_bw_gbs if inside[dim] else hw.inter_bw_gbs
        return nbytes * _WIRE.get(collective, lambda n: 1.0)(P) / (bw * 1e9)

    ep_link = {"ep@intra": hw.intra_bw_gbs, "ep@inter": hw.inter_bw_gbs}  # expert_nodes.py

    hides_a2a = a2a_overlapped(w, plan)   # the prediction may hide all of it: left out

    def book(collective, dim, nbytes, calls=1):   # calls' latency left out: a lower bound
        if hides_a2a and collective == "a2a" and (dim in ep_link or dim == "ep"):
            return
        if dim in ep_link:
            total[0] += nbytes * _WIRE[collective](sizes["ep"]) / (ep_link[dim] * 1e9)
        elif dim in sizes:
            surely = dim in stretched or (dim == "tp" and collective != "reduce")
            total[0 if surely else 1] += seconds(collective, dim, nbytes)
    if pipeline:
        _pipeline(w, plan, state, book)
    _experts(w, plan, state, book, hw.gpus_per_node)
    _context(w, plan, state, book)
    if plan.tp > 1 and plan.tp_mode == "1d":
        out = Counter()
        _tensor(w, plan, state, book, out, [])
        total[0] += seconds("pair", "tp", out["tensor_parallel"])
    elif plan.tp > 1:
        _grid_tensor(w, plan, state, book)
    return tuple(total)


@dataclasses.dataclass(frozen=True)
class _Variant:
    """The fields of a plan _sync_factor reads (a ZeRO / offload / ZeRO++ variant)."""
    zero: int
    offload: str
    zeropp_quantize_weights: bool
    zeropp_quantize_grads: bool
    zeropp_hpz: int


def _sync_factor(plan, m: int) -> tuple:
    """(dense, expert): times (P-1)/P of the gradient bytes the layout's ZeRO setting moves
    at least (comm.py): all-reduce 2; ZeRO-1 + the slices' gather; ZeRO-2 reduce-scatter
    (qgZ: int8, >= 1/4) + gather; ZeRO-3 the forward gathers of every micro-batch (qwZ
    >= 1/4) + the reduce-scatter, and for the experts without hpZ the backward gathers too
    (an expert unit is never the root, which stays gathered; with hpZ they stay in the
    node, and the dense side's root share is left out)."""
    q = 0.25
    scatter = q if plan.zeropp_quantize_grads else 1.0
    if plan.zero != 3:
        f = {0: 2.0, 1: 3.0, 2: scatter + 1.0}[plan.zero]
        return f, f
    gathers = m * (q if plan.zeropp_quantize_weights else 1.0)
    return gathers + scatter, gathers * (1 if plan.zeropp_hpz else 2) + scatter


def _least_factors(zero_variants, m: int) -> tuple:
    """(dense, expert): each side's least _sync_factor over the ZeRO variants (field dicts)."""
    factors = [_sync_factor(_Variant(**v), m) for v in zero_variants]
    return tuple(min(f[k] for f in factors) for k in (0, 1))


def variant_bound(w, plan, costs, hw, sizes, stages, sync_factor: tuple = None,
                  hidden: bool = None) -> float:
    """A lower bound of one layout's step_s: every stage's compute (flops.rank_flops, exact
    from its blocks) and the traffic step_time surely runs inside the step, stretched by
    the bubble, plus its other traffic (inside_seconds: comm.py's expert all-to-all, expert-
    tensor, pipeline, tensor- and context-parallel terms) and its gradient synchronisation
    at the layout's ZeRO setting (the group: its cheapest) from the bytes surely on it
    (_stage_sizes); and the mean stage's with the whole model's gradient bytes over pp.
    hidden (default: ZeRO-3): the synchronisation runs beside the compute, the longer counts."""
    from .comm import micro_count
    from .flops import rank_flops
    bubble = bubble_fraction(plan.pp_schedule, plan.pp, plan.microbatches, plan.stages_per_rank)
    s = dict(dp=plan.dp, cp=plan.cp, tp=plan.tp, pp=plan.pp, ep=plan.ep, etp=plan.etp)
    if sync_factor is None:
        sync_factor = _sync_factor(plan, micro_count(w, plan))
    if hidden is None:
        hidden = plan.zero == 3

    def total(x, y):
        return max(x, y) if hidden else x + y

    def sync(held, stages_over):
        return sum(t * f for t, f in zip(sync_seconds(s, held, hw, stages_over), sync_factor))
    held = [sizes] if plan.pp == 1 else _stage_sizes(_block_bytes(w), stages)
    xs, worst = [], 0.0
    slowdown, fp8 = expert_gemm_slowdown(w, plan, hw), fp8_gemm_time(plan, hw, w)
    for st, own in zip(stages, held):
        compute = rank_flops(costs, w, plan, st, slowdown, fp8) / (hw.tflops * 1e12)
        if costs.step_bytes is not None:  # its memory-bound work per token (traced_bytes.py)
            compute += token_bytes(costs.step_bytes, w, plan, st.block_ids, st.last_stage) / \
                membound_bandwidth(hw, plan.compiled)
        stretched, rest = inside_seconds(w, plan, st, hw)
        xs.append((compute + stretched) / (1 - bubble) + rest)
        worst = max(worst, total(xs[-1], sync(own, 1)))
    return max(worst, total(sum(xs) / len(xs), sync(sizes, plan.pp)))


def _with_layers(w, plan, memo: dict):
    """The plan with its pp_layers resolved as validate would (ValueError where it cannot);
    memo: {(spec, stages): resolved or the error} (the balancer is exact but not free)."""
    if plan.pp == 1:
        return plan
    key = (plan.pp_layers, plan.num_stages)
    if key not in memo:
        from ..pipeline.layers import resolve
        moe = w.moe_cfg if w.has_moe() else None
        try:
            memo[key] = resolve(plan.pp_layers, plan.num_stages, w.model_cfg, moe,
                                w.stream_tokens.get("decoder"))
        except ValueError as e:
            memo[key] = e
    if isinstance(memo[key], ValueError):
        raise ValueError(*memo[key].args)
    return dataclasses.replace(plan, pp_layers=memo[key])


def _groups(w, base, s, world, hw, costs, sizes, memo, zeros, recomputes, offloads, zeropp,
            gpus_per_node) -> list:
    """[(bound, (s, schedule, m, stages)) or None (even its leanest layout overflows)] of a
    structure: the bound of its fastest conceivable layout (no recomputation, the ZeRO
    setting that moves the fewest bytes), the memory of its leanest (the highest ZeRO stage,
    the deepest offload, recomputation)."""
    from .comm import micro_count
    out = []
    zero_variants = variants(s, zeros, offloads, zeropp, gpus_per_node)
    depth = lambda v: (v["zero"], OFFLOAD_DEPTH.index(v["offload"]))  # noqa: E731
    deepest = max(depth(v) for v in zero_variants)
    # the highest ZeRO stage and deepest offload, each ZeRO++ form of it (hpZ, quantization:
    # their bounds differ, and the group stays while any of them may fit)
    leans = [v for v in zero_variants if depth(v) == deepest]
    for sch, m in pipelines(s["pp"]):
        plan = dataclasses.replace(base, **s, pp_schedule=sch, microbatches=m, pp_stages_per_rank=0,
                                   zero=max(zeros), recompute="none")
        plan = with_default_layers(plan, w.model_cfg.n_layers)
        try:
            plan = _with_layers(w, plan, memo)
        except ValueError as e:
            out.append(("refused", plan, rejection(e), len(zero_variants) * len(recomputes)))
            continue
        plain = dataclasses.replace(plan, **zero_variants[0])
        try:
            w.validate(plain, world)
        except ValueError as e:
            reason = rejection(e)
            if not any(f in reason for f in _VARIANT_FIELDS):  # the structure itself is refused
                out.append(("refused", plain, reason, len(zero_variants) * len(recomputes)))
                continue
        stages = _stage_blocks(w, plan)
        mc = micro_count(w, plan)
        rc = "full" if "full" in recomputes else "none"
        if min(memory_bound(w, dataclasses.replace(plan, **v, recompute=rc), sizes)
               for v in leans) > hw.gpu_mem_bytes:
            out.append(None)
            continue
        bound = min(variant_bound(w, plan, costs, hw, sizes, stages, _least_factors(g, mc), hidden)
                    for g, hidden in _by_hiding(zero_variants))
        out.append((bound * SLACK, (s, sch, m, stages)))
    return out


OFFLOAD_DEPTH = ("none", "optimizer", "params")
# a refusal naming none of these holds for every ZeRO / offload / recompute variant
_VARIANT_FIELDS = ("zero", "offload", "recompute", "zeropp", "hpz", "micro_batch", "optimizer")


def search(w, base, world: int, hw, costs, cache, top: int = 10, zeros=(0, 1, 2, 3),
           recomputes=("none", "full"), offloads=("none", "optimizer", "params"),
           zeropp=(False, True), gpus_per_node: int = 8, cps=(1,), cp_modes=("ring", "ulysses")) -> dict:
    """report.plan_all's result for the layouts examined, plus "examined"/"pruned" counts."""
    flops_s = {}
    fp8 = fp8_gemm_time(base, hw)   # < 1 under precision=fp8: every FLOP at the FP8 rate, a bound

    sb = cache.step_bytes(w, base.precision, base.param_dtype) if hw.hbm_tbs else None
    costs = dataclasses.replace(costs, step_bytes=sb)
    # the memory-bound bytes every token pays, over the world (each rank's share of them)
    per_token_s = 0.0 if sb is None else w.batch_size * sum(w.stream_tokens.values()) * \
        sum(u.per_token for u in sb.units.values()) / membound_bandwidth(hw, True)  # a bound

    def compute(s):
        imb = w.imbalance if s["ep"] > 1 else 1.0
        if imb not in flops_s:
            flops_s[imb] = model_flops(costs, w, imb) * fp8 / (hw.tflops * 1e12) + per_token_s
        return flops_s[imb] / world

    heap, tick = [], itertools.count()
    sizes = state_bytes(w.build_model())
    for s in structures(base, world, cps, cp_modes):
        bound = structure_bound(w, base, s, hw, sizes, compute(s),
                                variants(s, zeros, offloads, zeropp, gpus_per_node))
        heapq.heappush(heap, (bound * SLACK, next(tick), "structure", (s,)))
    fits, too_big, invalid = [], [], []
    examined = overflow = overflow_groups = 0
    refused_counts = collections.Counter()  # reason -> layouts (a refused group counts all)
    memo = {}
    n_layers = getattr(w.model_cfg, "n_layers", 0)

    best = []  # the top fitting step times, ascending

    def kth() -> float:
        return best[top - 1] if len(best) >= top else float("inf")

    while heap and heap[0][0] <= kth():
        _, _, kind, item = heapq.heappop(heap)
        if kind == "structure":
            for entry in _groups(w, base, item[0], world, hw, costs, sizes, memo, zeros,
                                 recomputes, offloads, zeropp, gpus_per_node):
                if entry is None:
                    overflow_groups += 1
                elif entry[0] == "refused":
                    invalid.append((entry[1], entry[2]))
                    refused_counts[entry[2]] += entry[3]
                else:
                    heapq.heappush(heap, (entry[0], next(tick), "group", entry[1]))
            continue
        if kind == "group":  # its layouts join the heap, each at its own bound
            s, sch, m, stages = item
            for v in variants(s, zeros, offloads, zeropp, gpus_per_node):
                for rc in recomputes:
                    plan = dataclasses.replace(base, **s, **v, recompute=rc, pp_schedule=sch,
                                               microbatches=m, pp_stages_per_rank=0)
                    plan = with_default_layers(plan, n_layers)
                    examined += 1
                    try:
                        plan = _with_layers(w, plan, memo)
                    except ValueError as e:
                        invalid.append((plan, rejection(e)))
                        refused_counts[rejection(e)] += 1
                        continue
                    bound = variant_bound(w, plan, costs, hw, sizes, stages) * SLACK
                    heapq.heappush(heap, (bound, next(tick), "layout", plan))
            continue
        plan = item
        try:
            if memory_bound(w, plan, sizes) > hw.gpu_mem_bytes:
                overflow += 1
                continue
            plan = w.validate(plan, world)
        except ValueError as e:
            invalid.append((plan, rejection(e)))
            refused_counts[rejection(e)] += 1
            continue
        try:
            pred = predict(w, plan, hw, costs, cache)
        except BUILD_ERRORS as e:
            invalid.append((plan, f"parallelize: {rejection(e)}"))
            refused_counts[f"parallelize: {rejection(e)}"] += 1
            continue
        if pred.fits:
            fits.append(pred)
            bisect.insort(best, pred.step_s)
            del best[top:]
        else:
            too_big.append(pred)
    pruned = sum(1 for e in heap if e[2] == "group") + \
        sum(len(pipelines(e[3][0]["pp"])) for e in heap if e[2] == "structure")
    slower = sum(1 for e in heap if e[2] == "layout")  # examined, never reached
    fits.sort(key=rank_key)
    too_big.sort(key=lambda p: p.peak_bytes)
    return {"fits": fits, "too_big": too_big, "invalid": invalid, "examined": examined,
            "pruned_groups": pruned, "bounded_slower": slower, "bounded_overflow": overflow,
            "overflow_groups": overflow_groups, "refused_counts": dict(refused_counts),
            "predicted": len(fits) + len(too_big)}
