"""Expert parallelism (parallel/expert.py): ep and etp against the stage's pool, what the MoE
config makes of the blocks (_has_moe, _has_dense_ffn, whole-sequence routing), hot-expert
replicas, the dispatch dtype, node-aware dispatch and the ep groups, the all-to-all overlaps."""
from __future__ import annotations  # ParallelPlan (parallel/plan.py) is named in hints only

from moe.config import routes_per_sequence

from . import _err
from .choices import A2A_OVERLAPS


def _check_ep(p: ParallelPlan) -> None:
    pool = "dp*cp*tp" if p.cp > 1 else "dp*tp"
    sizes = f"{p.dp}*{p.cp}*{p.tp}" if p.cp > 1 else f"{p.dp}*{p.tp}"
    if p.pool % p.ep:
        raise _err(f"parallel.ep={p.ep} must divide {pool} = {sizes} = {p.pool} (experts "
                   f"are spread over the ranks of one pipeline stage); lower ep or raise dp")
    if p.pool % (p.ep * p.etp):
        raise _err(f"parallel.ep*etp = {p.ep}*{p.etp} must divide {pool} = {sizes} = "
                   f"{p.pool} (each expert's d_ff is split over etp of one stage's ranks); "
                   f"lower etp or raise dp")


def _routes_whole_sequences(moe_cfg) -> bool:
    """MoE layers that must be handed whole sequences (moe.config.routes_per_sequence)."""
    return _has_moe(moe_cfg) and routes_per_sequence(
        getattr(moe_cfg, "router", "token_choice"), getattr(moe_cfg, "capacity_factor", None),
        getattr(moe_cfg, "eval_capacity_factor", "same"))


def _has_moe(moe_cfg) -> bool:
    return moe_cfg is not None and getattr(moe_cfg, "every", 1) != 0 and \
        getattr(moe_cfg, "num_experts", 0) > 0


def _has_dense_ffn(moe_cfg) -> bool:
    """Whether some block keeps a dense FFN (moe_cfg None: a dense model, or not known)."""
    return not _has_moe(moe_cfg) or moe_cfg.every != 1 or getattr(moe_cfg, "first_moe_layer", 0) > 0


def _check_replicas(p: ParallelPlan, moe_cfg) -> None:
    R, E = getattr(moe_cfg, "replica_slots", 0), moe_cfg.num_experts
    if R and p.ep == 1:
        raise _err(f"moe.replica_slots={R} replicates hot experts across expert-parallel ranks, "
                   f"but parallel.ep=1; set parallel.ep > 1 or moe.replica_slots=0")
    if R and p.etp > 1:
        raise _err(f"moe.replica_slots={R} with parallel.etp={p.etp}: replica placement is decided "
                   f"per expert-parallel group and would differ between the ranks that split an "
                   f"expert; set moe.replica_slots=0 or parallel.etp=1")
    if p.ep > 1 and E % p.ep == 0 and R > E - E // p.ep:
        raise _err(f"moe.replica_slots={R} exceeds the {E - E // p.ep} experts an ep rank does "
                   f"not own (moe.num_experts={E}, parallel.ep={p.ep}); use at most {E - E // p.ep}")


def _check_dispatch_dtype(p: ParallelPlan, moe_cfg) -> None:
    if getattr(moe_cfg, "dispatch_dtype", "auto") == "fp8" and p.precision == "fp16":
        raise _err("moe.dispatch_dtype=fp8 sends the gradients and the combine in bf16, which "
                   "parallel.precision=fp16's loss scaling does not expect; use precision=bf16 "
                   "(or fp32), or moe.dispatch_dtype=auto")


def ep_group_of(p: ParallelPlan, rank: int) -> list:
    """The global ranks of `rank`'s expert-parallel group (mesh.py's rank order: pp
    outermost, a stage's pool as (edp, ep, etp), etp innermost; tests/unit check it against
    mesh.rank_groups)."""
    stage, pos = divmod(rank, p.pool)
    e, t = pos // (p.ep * p.etp), pos % p.etp
    return [stage * p.pool + (e * p.ep + i) * p.etp + t for i in range(p.ep)]


def ep_group_ranks(p: ParallelPlan) -> list:
    """Every expert-parallel group's global ranks."""
    return [ep_group_of(p, stage * p.pool + e * p.ep * p.etp + t)
            for stage in range(p.pp) for e in range(p.edp) for t in range(p.etp)]


def _check_nodes(p: ParallelPlan, moe_cfg) -> None:
    g, mode, M = p.gpus_per_node, getattr(moe_cfg, "dispatch", "flat"), getattr(moe_cfg, "max_nodes", 0)
    if isinstance(g, bool) or not isinstance(g, int) or g < 0:
        raise _err(f"parallel.gpus_per_node={g!r} must be an integer >= 0 (0 = the launcher's "
                   f"local world size)")
    if g and p.world % g:
        raise _err(f"parallel.gpus_per_node={g} does not divide the {p.world} ranks into whole "
                   f"nodes; use a divisor of the world size")
    for field_, on in (("dispatch=hierarchical", mode == "hierarchical"), (f"max_nodes={M}", M)):
        if on and p.ep == 1:
            raise _err(f"moe.{field_} works on the nodes of the expert-parallel group, but "
                       f"parallel.ep=1; set parallel.ep > 1 or leave moe.{field_.split('=')[0]} "
                       f"at its default")
    if mode == "hierarchical" and getattr(moe_cfg, "a2a_overlap_degree", 1) > 1:
        raise _err(f"moe.dispatch=hierarchical with moe.a2a_overlap_degree="
                   f"{moe_cfg.a2a_overlap_degree}: the chunked overlap runs the flat exchange; "
                   f"set moe.a2a_overlap_degree=1 or moe.dispatch=flat")
    if M and getattr(moe_cfg, "replica_slots", 0):
        raise _err(f"moe.max_nodes={M} with moe.replica_slots={moe_cfg.replica_slots}: a replica "
                   f"may sit on another node than its expert, so the nodes a token reaches are "
                   f"not its experts' nodes; set one of them to 0")
    if g and p.ep > 1 and (mode == "hierarchical" or M):
        from moe.nodes import expert_nodes
        # the same number of ep ranks on every node; groups may span different node counts
        spans = {expert_nodes(ranks, g).num_nodes for ranks in ep_group_ranks(p)}
        if M and len(spans) > 1:  # the routing would differ between expert-data-parallel copies
            raise _err(f"moe.max_nodes={M}: the expert-parallel groups span {sorted(spans)} nodes of "
                       f"parallel.gpus_per_node={g} ranks, so tokens would be routed differently "
                       f"on different groups; choose gpus_per_node so that every ep group spans "
                       f"the same number of nodes (e.g. a multiple of ep*etp or a divisor of it)")
        for n in sorted(spans) if M else ():
            _check_node_routing(moe_cfg, n)


def _check_node_routing(moe_cfg, n: int) -> None:
    """max_nodes against the experts' n nodes: the router's own check, before any collective."""
    from moe.config import RoutingConfig
    try:
        RoutingConfig(num_experts=moe_cfg.num_experts, top_k=moe_cfg.top_k,
                      n_group=moe_cfg.n_group, topk_group=moe_cfg.topk_group or None,
                      max_nodes=moe_cfg.max_nodes, expert_nodes=n)
    except ValueError as e:
        raise _err(f"moe.{e} (the experts span {n} nodes of parallel.gpus_per_node ranks)") from None


def _check_a2a_overlap(p: ParallelPlan, moe_cfg) -> None:
    if p.a2a_overlap not in A2A_OVERLAPS:
        raise _err(f"parallel.a2a_overlap={p.a2a_overlap!r} is not supported; use one of {A2A_OVERLAPS}")
    if p.a2a_overlap == "none":
        return
    unpaired = p.pp > 1 and p.pp_schedule == "gpipe"  # (2bw refuses ep > 1 itself)
    # a pair's forward ends after the backward's interleaved pieces, and in the 1F1B family
    # the next stage waits for that output: simulated 1.05-1.4x the plain step until the
    # exchanges are as long as the compute (parallel/pipeline/simulate.py); the V schedules'
    # pairs gain from a quarter of it
    delayed = p.pp > 1 and p.pp_schedule in ("1f1b", "interleaved_1f1b", "zb_interleaved")
    for bad, why in ((p.ep == 1, "parallel.ep=1 has no expert all-to-all to hide; set parallel.ep > 1"),
                     (unpaired, f"parallel.pp_schedule={p.pp_schedule} never runs a forward next to a "
                                f"backward of another micro-batch; use zbv or dualpipev"),
                     (delayed, f"inside parallel.pp_schedule={p.pp_schedule} each pair's forward output "
                               f"leaves after the backward's interleaved pieces and the next stage "
                               f"waits for it (simulated 1.05-1.4x the plain step); use "
                               f"parallel.pp_schedule=zbv or dualpipev, or moe.a2a_overlap_degree > 1"),
                     (p.ps_servers > 0, "the parameter server runs one micro-batch at a time; set "
                                        "parallel.ps_servers=0"),
                     (getattr(moe_cfg, "a2a_overlap_degree", 1) > 1,
                      "moe.a2a_overlap_degree > 1 waits for its own chunks; use one of the two overlaps")):
        if bad:
            raise _err(f"parallel.a2a_overlap={p.a2a_overlap}: {why} (or parallel.a2a_overlap=none)")


def _check_overlap(p: ParallelPlan, moe_cfg) -> None:
    d = getattr(moe_cfg, "a2a_overlap_degree", 1)
    if d > 1 and p.ep == 1:
        raise _err(f"moe.a2a_overlap_degree={d} overlaps the expert-parallel all-to-all, but "
                   f"parallel.ep=1 has none; set parallel.ep > 1 or moe.a2a_overlap_degree=1")


def _check_etp_model(p: ParallelPlan, m, moe_cfg) -> None:
    """Expert tensor parallelism splits the routed experts' d_ff (moe/expert_tp.py)."""
    if moe_cfg is not None and not _has_moe(moe_cfg):
        raise _err(f"parallel.etp={p.etp} splits routed experts, and moe.every=0 makes a dense "
                   f"model; set etp=1")
    if moe_cfg is None:
        return
    d_ff = getattr(moe_cfg, "d_ff", 0) or getattr(m, "d_ff", 0)
    if d_ff % p.etp:
        raise _err(f"the experts' d_ff={d_ff} (moe.d_ff, else model.d_ff) is not divisible by "
                   f"parallel.etp={p.etp}; pick an etp that divides it")
    if getattr(m, "bias", False) and getattr(m, "arch", "gpt") == "gpt":
        raise _err(f"parallel.etp={p.etp} with model.bias=true: the experts' output bias is added "
                   f"once per row, not per d_ff slice; set model.bias=false or parallel.etp=1")
