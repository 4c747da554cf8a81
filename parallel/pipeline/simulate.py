"""A schedule simulation of one pipeline step: what the planner's price of the all-to-all
overlap's pairs (parallel.a2a_overlap=1f1b under pp > 1) is checked against.

    simulate(schedule, pp, m, v, cost)  -> seconds of the step (the last action's end)

Each pipeline rank runs torch's compute order (paired_steps.torch_order; with `cost.paired`, the
order parallel/pipeline/paired_steps.py merges into forward/backward pairs) one action at a time.
A forward of stage s needs stage s-1's output for its micro-batch, a backward stage s+1's
gradient (the last stage: its own forward). Each action runs `layers` pieces of compute, an
expert all-to-all after each (a forward's compute f and all-to-all a_f in all, a backward's
b and a_b; a weight-gradient half, W, computes only), waited for at once when alone. A pair
runs as parallel/interleave.py's baton does: the forward's pieces first, handing over to
the other half at every all-to-all, taking it back when that half reaches one of its own or
ends, so each half's exchange flies while the other computes. `cost.send` says when a
pair's outputs leave: "half" as each half ends (the runtime here), "pair" after both
(what it did before: neighbouring stages then take turns).
"""
import functools
from dataclasses import dataclass

from torch.distributed.pipelining import schedules as ts

__all__ = ["StepCost", "simulate"]


@dataclass(frozen=True)
class StepCost:
    f: float = 1.0          # one stage's forward compute of one micro-batch
    b: float = 2.0          # its backward compute (input and weight gradients)
    a_f: float = 0.0        # the forward's expert all-to-all time
    a_b: float = 0.0        # the backward's
    layers: int = 4         # MoE layers a stage runs (pieces between exchanges)
    paired: bool = False    # run the overlap's pairs
    send: str = "half"      # "half" | "pair": when a pair's outputs leave


def _parts(a, cost: StepCost) -> tuple:
    """(compute, all-to-all) of one action."""
    t = a.computation_type
    if t == ts.FORWARD:
        return cost.f, cost.a_f
    if t == ts.FULL_BACKWARD:
        return cost.b, cost.a_b
    if t == ts.BACKWARD_INPUT:
        return cost.b / 2, cost.a_b
    return cost.b / 2, 0.0  # BACKWARD_WEIGHT: no exchange


def _alone(start: float, compute: float, a2a: float, layers: int) -> float:
    return start + compute + a2a  # each piece waits for its exchange


def _pair(start_f: float, start_b: float, fc, fa, bc, ba, layers: int) -> tuple:
    """(forward's end, backward's end) of a pair run by the baton: pieces of compute/layers,
    an exchange of a/layers after each. A half at a wait (its input, an exchange) hands the
    turn over and, when it gets it back, waits there for its item: while both run, they
    alternate, the forward first; the one left runs on alone."""
    halves = {"F": [fc / layers, fa / layers, layers, start_f],   # compute, a2a, left, ready
              "B": [bc / layers, ba / layers, layers, start_b]}
    now, turn, ends = 0.0, "F", {}
    while len(ends) < 2:
        c, a, left, ready = halves[turn]
        now = max(now, ready) + c
        halves[turn][2], halves[turn][3] = left - 1, now + a
        if left == 1:
            ends[turn] = now + a
        other = "B" if turn == "F" else "F"
        turn = other if other not in ends else turn
    return ends["F"], ends["B"]


@functools.cache
def _order(schedule: str, pp: int, m: int, v: int, paired: bool) -> dict:
    from .paired_steps import _first_lowering, _lowers, torch_order
    to_rank, order = torch_order(schedule, pp, m, v)
    if paired:
        order = _first_lowering(order, lambda o: _lowers(o, to_rank, m))
        if order is None:
            raise ValueError(f"{schedule} pp{pp} m{m}: no pairing lowers")
    return order


def simulate(schedule: str, pp: int, m: int, v: int, cost: StepCost) -> float:
    """Seconds of one step of pp_schedule `schedule` (pp ranks, m micro-batches, v stages
    per rank) under `cost`; ValueError if the order cannot complete."""
    order = _order(schedule, pp, m, v, cost.paired)
    stages = pp * v
    done = {}   # (kind, stage, mb) -> when its output is there ("F": activations, "B": gradient)
    queues = {r: [a for a in acts if a is not None] for r, acts in order.items()}
    free = {r: 0.0 for r in queues}

    def needs(a):
        s, mb = a.stage_index, a.microbatch_index
        if a.computation_type == ts.FORWARD:
            return None if s == 0 else ("F", s - 1, mb)
        if a.computation_type == ts.BACKWARD_WEIGHT:
            return ("B", s, mb)
        return ("F", s, mb) if s == stages - 1 else ("B", s + 1, mb)

    def kind(a):
        return "F" if a.computation_type == ts.FORWARD else "W" if \
            a.computation_type == ts.BACKWARD_WEIGHT else "B"

    def ready(a):
        need = needs(a)
        return 0.0 if need is None else done.get(need)

    while any(queues.values()):
        progressed = False
        for r, q in queues.items():
            while q:
                a = q[0]
                if a.computation_type == ts.OVERLAP_F_B:
                    f, b = a.sub_actions
                    rf, rb = ready(f), ready(b)
                    if rf is None or rb is None:
                        break
                    fc, fa = _parts(f, cost)
                    bc, ba = _parts(b, cost)
                    if cost.send == "pair":
                        start = max(free[r], rf, rb)
                        end_f, end_b = _pair(start, start, fc, fa, bc, ba, cost.layers)
                        end_f = end_b = max(end_f, end_b)
                    else:
                        end_f, end_b = _pair(max(free[r], rf), max(free[r], rb), fc, fa, bc, ba,
                                             cost.layers)
                    done[("F", f.stage_index, f.microbatch_index)] = end_f
                    done[(kind(b), b.stage_index, b.microbatch_index)] = end_b
                    free[r] = max(end_f, end_b)
                else:
                    t = ready(a)
                    if t is None:
                        break
                    c, x = _parts(a, cost)
                    free[r] = _alone(max(free[r], t), c, x, cost.layers)
                    done[(kind(a), a.stage_index, a.microbatch_index)] = free[r]
                q.pop(0)
                progressed = True
        if not progressed:
            raise ValueError(f"{schedule} pp{pp} m{m}: the order cannot complete")
    return max(free.values())
