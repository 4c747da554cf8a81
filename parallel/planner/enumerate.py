"""Every layout of a world size that ParallelPlan.validate (or the caller's check) accepts.

The candidate degrees are all factorizations world = dp * cp * tp * pp (cp from the caller's
list, each cp > 1 in both modes, ring and ulysses), each tp in every
tensor-parallel form it can take (1d; 2d where tp = q*q; 2.5d for every depth d with
tp = q*q*d), every ep dividing dp*cp*tp
and every etp dividing dp*cp*tp/ep (expert tensor parallelism), ZeRO 0-3, recompute none/full
and, with pp > 1, each schedule with micro-batch counts pp, 2pp, 4pp and 8pp; and the ZeRO
family: offload none/optimizer/params, ZeRO++ off/on (on = qwZ + qgZ under ZeRO-3, qgZ under
ZeRO-2) and, under ZeRO-3, hpZ off or with the dp ranks of one node (gpus_per_node / tp).
Blocks per stage: the base plan's parallel.pp_layers; when that is even and the layers do
not divide the stages, auto (balanced: parallel/pipeline/layers.py).
validate decides which of them are layouts (it alone knows the rules). Precision and compile
come from the base plan unchanged.
"""
import dataclasses
import itertools

from ..pipeline.schedules import PP_SCHEDULES
from ..plan import CP_MODES


def rejection(e: Exception) -> str:
    """The first line of a validation or build error: the reason a layout cannot run."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


OFFLOADS = ("none", "optimizer", "params")
ZEROPP = (False, True)


def candidates(base, world: int, zeros=(0, 1, 2, 3), recomputes=("none", "full"),
               offloads=OFFLOADS, zeropp=ZEROPP, gpus_per_node: int = 8, cps=(1,),
               cp_modes=CP_MODES) -> list:
    out = []
    for s in structures(base, world, cps, cp_modes):
        for v in variants(s, zeros, offloads, zeropp, gpus_per_node):
            for rc in recomputes:
                for sched, mb in pipelines(s["pp"]):
                    out.append(dataclasses.replace(base, **s, **v, recompute=rc, pp_schedule=sched,
                                                   microbatches=mb, pp_stages_per_rank=0))
    return out


def variants(s: dict, zeros, offloads, zeropp, gpus_per_node: int) -> list:
    """The ZeRO / offload / ZeRO++ settings of structure s, as field dicts, zero by zero
    (_zero_family's at each): what candidates and the search's groups expand into."""
    return [dict(zero=z, **f) for z in zeros
            for f in _zero_family(z, s["dp"], s["tp"], offloads, zeropp, gpus_per_node)]


def structures(base, world: int, cps, cp_modes) -> list:
    """[{dp, tp, tp_mode, tp_depth, pp, cp, cp_mode, ep, etp}]: every way of laying the
    degrees over `world` (the outer loops of candidates, in its order; the search's groups)."""
    out = []
    for tp, pp, cp in _degrees(world, cps):
        dp = world // (tp * pp * cp)
        modes = cp_modes if cp > 1 else (base.cp_mode,)
        for (tp_mode, depth), (ep, etp), cp_mode in itertools.product(
                _tp_modes(tp), _expert_degrees(dp * cp * tp), modes):
            out.append(dict(dp=dp, tp=tp, tp_mode=tp_mode, tp_depth=depth, pp=pp, cp=cp,
                            cp_mode=cp_mode, ep=ep, etp=etp))
    return out


def pipelines(pp: int) -> list:
    """(schedule, micro-batches) of a pipeline degree: each schedule with pp, 2pp, 4pp, 8pp."""
    if pp == 1:
        return [("1f1b", 0)]
    return [(s, m) for s in PP_SCHEDULES for m in (pp, 2 * pp, 4 * pp, 8 * pp)]


def with_default_layers(plan, n_layers: int):
    """The plan, with pp_layers=auto where it asks for even stages that the layers do not
    divide (uneven counts are planned balanced)."""
    if plan.pp > 1 and not plan.pp_layers and n_layers % plan.num_stages:
        return dataclasses.replace(plan, pp_layers="auto")
    return plan


def _degrees(world: int, cps) -> list:
    """(tp, pp, cp) with tp * pp * cp dividing the world (cp from `cps`)."""
    return [(tp, pp, cp) for tp in _divisors(world) for pp in _divisors(world // tp)
            for cp in cps if (world // (tp * pp)) % cp == 0]


def _tp_modes(tp: int) -> list:
    """(tp_mode, tp_depth): 1d always; 2d where tp = q*q; 2.5d for each depth d > 1 with
    tp = q*q*d (q >= 2)."""
    out = [("1d", 1)]
    for d in _divisors(tp):
        q = round((tp // d) ** 0.5)
        if q >= 2 and q * q * d == tp:
            out.append(("2d", 1) if d == 1 else ("2.5d", d))
    return out


def _expert_degrees(pool: int) -> list:
    """(ep, etp) with ep * etp dividing the pool of a stage's dp*tp ranks."""
    return [(ep, etp) for ep in _divisors(pool) for etp in _divisors(pool // ep)]


def _zero_family(zero: int, dp: int, tp: int, offloads, zeropp, gpus_per_node: int) -> list:
    """The offload / ZeRO++ settings that exist at a ZeRO stage (offload=optimizer needs
    zero >= 1, offload=params zero 3: listing the others would only fill the refused table
    with validate's messages for them). zeropp False: none of ZeRO++; True: each of
    quantization (qwZ+qgZ, or qgZ at ZeRO-2) and hpZ over one node's dp ranks (when a node
    holds more than one), alone and together, where the stage has it."""
    offloads = [o for o in offloads if o == "none" or (o == "optimizer" and zero >= 1) or zero == 3]
    node_dp = gpus_per_node // tp
    hpz = node_dp if zero == 3 and 1 < node_dp < dp and dp % node_dp == 0 else 0
    combos = set()
    for on in zeropp:
        if not on:
            combos.add((False, 0))
            continue
        if zero >= 2:
            combos.add((True, 0))
        if hpz:
            combos.update({(False, hpz), (True, hpz)})
    return [dict(offload=offload, zeropp_quantize_weights=quant and zero == 3,
                 zeropp_quantize_grads=quant, zeropp_hpz=h)
            for offload in offloads for quant, h in sorted(combos)]


def layouts(w, base, world: int, **kw) -> tuple:
    """([validated plans], [(candidate plan, reason)])."""
    ok, rejected = [], []
    n_layers = getattr(w.model_cfg, "n_layers", 0)
    for plan in candidates(base, world, **kw):
        plan = with_default_layers(plan, n_layers)
        try:
            ok.append(w.validate(plan, world))
        except ValueError as e:
            rejected.append((plan, rejection(e)))
    return ok, rejected
