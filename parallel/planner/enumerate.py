"""Every layout of a world size that ParallelPlan.validate (or the caller's check) accepts.

The candidate degrees are all factorizations world = dp * tp * pp, every ep dividing dp*tp,
ZeRO 0-3, recompute none/full and, with pp > 1, each schedule with micro-batch counts
pp, 2pp, 4pp and 8pp; validate decides which of them are layouts (it alone knows the rules).
Precision and compile come from the base plan unchanged.
"""
import dataclasses



def rejection(e: Exception) -> str:
    """The first line of a validation or build error: the reason a layout cannot run."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(base, world: int, zeros=(0, 1, 2, 3), recomputes=("none", "full")) -> list:
    out = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            schedules = ("gpipe", "1f1b", "interleaved_1f1b") if pp > 1 else ("1f1b",)
            mbs = (pp, 2 * pp, 4 * pp, 8 * pp) if pp > 1 else (0,)
            for ep in _divisors(dp * tp):
                for zero in zeros:
                    for rc in recomputes:
                        for sched in schedules:
                            for mb in mbs:
                                out.append(dataclasses.replace(
                                    base, dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, recompute=rc,
                                    pp_schedule=sched, microbatches=mb, pp_stages_per_rank=0))
    return out


def layouts(w, base, world: int, **kw) -> tuple:
    """([validated plans], [(candidate plan, reason)])."""
    ok, rejected = [], []
    for plan in candidates(base, world, **kw):
        try:
            ok.append(w.validate(plan, world))
        except ValueError as e:
            rejected.append((plan, rejection(e)))
    return ok, rejected
