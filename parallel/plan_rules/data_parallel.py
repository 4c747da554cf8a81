"""Data parallelism beyond plain all-reduce (parallel/data_parallel/): ZeRO's offload,
ZeRO++ and prefetch flags, bf16 parameters with fp32 masters, and the parameter server."""
from __future__ import annotations  # ParallelPlan (parallel/plan.py) is named in hints only

from ..pipeline.schedules import ZERO_BUBBLE
from . import _err
from .choices import OFFLOADS, PARAM_DTYPES


def _check_param_dtype(p: ParallelPlan) -> None:
    """bf16 parameters need somewhere to keep the fp32 masters: ZeRO-1/2's slices."""
    if p.param_dtype not in PARAM_DTYPES:
        raise _err(f"parallel.param_dtype={p.param_dtype!r} is not supported; use one of "
                   f"{', '.join(PARAM_DTYPES)}")
    if p.param_dtype == "fp32":
        return
    for bad, fix in ((p.zero == 0, "parallel.zero=0: set parallel.zero=1, 2 or 3 (the fp32 masters "
                      "live in ZeRO-1/2's slices or are ZeRO-3's shards; zero=1 works with dp=1)"),
                     (p.zero == 3 and p.offload != "none", f"parallel.offload={p.offload!r} under "
                      f"ZeRO-3: set offload='none' (or parallel.zero=1/2 with offload='optimizer')"),
                     (p.precision != "bf16", f"parallel.precision={p.precision}: set precision=bf16 "
                      f"(autocast runs the bf16 weights' matmuls; fp16 would need loss scaling)"),
                     (p.ps_servers > 0, f"parallel.ps_servers={p.ps_servers}: set ps_servers=0 "
                      f"(the servers keep their own fp32 copies)"),
                     (p.pp > 1 and p.pp_schedule == "2bw", "parallel.pp_schedule=2bw: use another "
                      "schedule (2bw keeps its own weight versions)"),
                     (p.tp > 1 and p.zero in (1, 2), f"parallel.tp={p.tp} under ZeRO-{p.zero}: "
                      f"casting tensor-parallel weights (DTensors) to bf16 beside their fp32 "
                      f"slices is not implemented (their local blocks stayed fp32 and the first "
                      f"forward failed); set parallel.param_dtype=fp32 or parallel.tp=1")):
        if bad:
            raise _err(f"parallel.param_dtype={p.param_dtype} with {fix}")


def _check_zero_family(p: ParallelPlan) -> None:
    """offload and the ZeRO++ flags: each names the stage it needs."""
    if p.offload not in OFFLOADS:
        raise _err(f"parallel.offload={p.offload!r} is not supported; use one of {', '.join(OFFLOADS)}")
    if p.offload == "optimizer" and p.zero == 0:
        raise _err("parallel.offload='optimizer' needs a ZeRO optimizer to offload; set "
                   "parallel.zero=1, 2 or 3 (or offload='none')")
    if p.offload == "params" and p.zero != 3:
        raise _err(f"parallel.offload='params' offloads sharded parameters, which exist under ZeRO-3 "
                   f"only (got zero={p.zero}); set parallel.zero=3, or offload='optimizer'")
    for name in ("zeropp_quantize_weights", "zeropp_quantize_grads"):
        if not isinstance(getattr(p, name), bool):
            raise _err(f"parallel.{name}={getattr(p, name)!r} must be true or false")
    if p.zeropp_quantize_weights and p.zero != 3:
        raise _err(f"parallel.zeropp_quantize_weights=true quantizes ZeRO-3 parameter gathers "
                   f"(got zero={p.zero}); set parallel.zero=3 or zeropp_quantize_weights=false")
    if p.zeropp_quantize_grads and p.zero not in (2, 3):
        raise _err(f"parallel.zeropp_quantize_grads=true quantizes the gradient reduce-scatter of "
                   f"ZeRO-2/3 (got zero={p.zero}); set parallel.zero=2 or 3")
    _check_hpz(p)
    _check_param_dtype(p)
    if p.zero == 3 and p.pp > 1 and p.pp_schedule in ZERO_BUBBLE:
        raise _err(f"parallel.pp_schedule={p.pp_schedule} with parallel.zero=3: the zero-bubble "
                   f"schedules compute weight gradients after FSDP2 has reduce-scattered the "
                   f"stage's gradients, so those are lost (measured); use parallel.zero=1 or 2, or "
                   f"pp_schedule=1f1b / interleaved_1f1b with zero 3")


def _check_ps(p: ParallelPlan) -> None:
    S, s = p.ps_servers, p.ps_staleness
    for name, v in (("ps_servers", S), ("ps_staleness", s)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise _err(f"parallel.{name}={v!r} must be an integer >= 0")
    if s and not S:
        raise _err(f"parallel.ps_staleness={s} needs the parameter-server layout; set "
                   f"parallel.ps_servers >= 1 or ps_staleness=0")
    if not S:
        return
    if S > p.world:
        raise _err(f"parallel.ps_servers={S} exceeds the {p.world} ranks (every server shard "
                   f"lives on a rank that is also a worker); use at most {p.world}")
    for name, value, ok in (("tp", p.tp, 1), ("pp", p.pp, 1), ("ep", p.ep, 1), ("etp", p.etp, 1),
                            ("zero", p.zero, 0)):
        if value != ok:
            raise _err(f"parallel.ps_servers={S} with parallel.{name}={value}: the parameter "
                       f"server replaces data-parallel all-reduce and keeps whole replicas on "
                       f"the workers; set parallel.{name}={ok} or ps_servers=0")
    for bad, fix in ((p.offload != "none", "parallel.offload=none (the servers already hold the "
                      "optimizer in host memory)"),
                     (p.precision == "fp16", "parallel.precision=fp32 or bf16 (fp16 loss scaling "
                      "needs every rank to agree on overflow each step)"),
                     (p.compile, "parallel.compile=false")):
        if bad:
            raise _err(f"parallel.ps_servers={S}: not served with this setting; set {fix}")


def _check_prefetch(p: ParallelPlan) -> None:
    n = p.zero_prefetch
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise _err(f"parallel.zero_prefetch={n!r} must be an integer >= 0 (0 = FSDP2's default)")
    if n and p.zero != 3:
        raise _err(f"parallel.zero_prefetch={n} prefetches ZeRO-3 parameter all-gathers (got "
                   f"zero={p.zero}); set parallel.zero=3 or zero_prefetch=0")


def _check_hpz(p: ParallelPlan) -> None:
    h = p.zeropp_hpz
    if not isinstance(h, int) or isinstance(h, bool) or h < 0:
        raise _err(f"parallel.zeropp_hpz={h!r} must be 0 (off) or the number of ranks per node")
    if h == 0:
        return
    if p.zero != 3:
        raise _err(f"parallel.zeropp_hpz={h} keeps a secondary ZeRO-3 parameter shard (got "
                   f"zero={p.zero}); set parallel.zero=3 or zeropp_hpz=0")
    if h >= p.dp or p.dp % h:
        raise _err(f"parallel.zeropp_hpz={h} must divide parallel.dp={p.dp} and be smaller than it "
                   f"(a node of {h} ranks inside the dp group); use a divisor of {p.dp} below it, or 0")
