"""The combined 1F1B inside a pipeline schedule (parallel.a2a_overlap=1f1b with pp > 1).

A pipeline rank's steady state alternates a forward of one micro-batch with a backward of
an earlier one. Here each such neighbouring pair becomes one OVERLAP_F_B action of torch's
schedule runtime (the action DualPipeV already emits, which torch runs one after the
other), and the action runs the two as interleaved pieces through the Baton
(parallel/interleave.py): the forward on a helper thread, the backward on the caller's,
switching at every expert all-to-all, so one's exchange flies while the other computes.

    overlapped_order(order)    compute-only order -> the same order with F;B pairs merged
    overlap_schedule(schedule, baton)   re-lower a runtime schedule with the merged order
                                        and run its OVERLAP_F_B actions through the baton
    paired_counts(schedule, pp, m, v)   the pairs each pipeline rank runs (the planner's
                                        hideable share), computed without a process group

Which pairs: a forward and a backward (whole, or its input-gradient half under the
zero-bubble schedules) of different micro-batches, next to each other in the rank's order
(idle slots between dropped), taken greedily from the front. They
are independent (a backward needs only its own micro-batch's forwards), so the pair's
pieces can run in any interleaving; the forwards keep their order and so do the backwards,
so every micro-batch runs the same operations in the same order as without the overlap and
gradients accumulate in the same order: the same function, bit for bit. Each half waits for
its own input (the forward for its activations, the backward for its output gradient; the
other half runs meanwhile, the baton handed over as at an exchange) and sends its output as
soon as it ends: a neighbour never waits for this rank's backward to receive its forward
input, so neighbouring stages do not take turns. torch's lowering (`_add_send_recv`) places
the receives so that no rank waits on a pair that waits on it (it refuses an order it
cannot schedule); the sends it puts after a pair are issued by the pair's halves instead.

1f1b itself runs as torch's interleaved 1F1B with one stage per rank (the same order as
Schedule1F1B, in the runtime that executes schedule IR). Uses torch 2.13's private schedule
runtime (`_PipelineScheduleRuntime`, `_Action`, the stage's forward/backward_one_chunk), as
torch's own DualPipeV does.
"""
from torch.distributed.pipelining import schedules as ts

from .schedules import SCHEDULES

__all__ = ["overlapped_order", "overlap_schedule", "pairs_of", "paired_counts", "torch_order"]

_BACKWARDS = (ts.FULL_BACKWARD, ts.BACKWARD_INPUT)


def _is(a, kinds) -> bool:
    return a is not None and a.computation_type in kinds


def _pair(a, b, either_order: bool):
    """(forward, backward) if a then b are a forward and a backward (or, with
    `either_order`, a backward and a forward) of different micro-batches, else None."""
    f, bw = (a, b) if _is(a, (ts.FORWARD,)) or not either_order else (b, a)
    if _is(f, (ts.FORWARD,)) and _is(bw, _BACKWARDS) and f.microbatch_index != bw.microbatch_index:
        return f, bw
    return None


def overlapped_order(order: dict, either_order: bool = True) -> dict:
    """{rank: [action | None]} with each forward merged with a neighbouring backward of
    another micro-batch (the one after it, or before it: the last stage's F0 B0 F1 B1 ...
    becomes F0 (F1;B0) (F2;B1) ... B{m-1}), idle slots between dropped, into one OVERLAP_F_B
    action, forward first. either_order=False: only a forward followed by a backward."""
    out = {}
    for rank, actions in order.items():
        merged, held = [], None  # held: a forward or backward waiting for its partner
        for a in actions:
            if a is None:
                continue
            pair = _pair(held, a, either_order) if held is not None else None
            if pair is not None:
                merged.append(ts._Action(-1, ts.OVERLAP_F_B, None, pair))
                held = None
            elif _is(a, (ts.FORWARD,) + _BACKWARDS):
                if held is not None:
                    merged.append(held)
                held = a
            else:
                if held is not None:
                    merged.append(held)
                merged.append(a)
                held = None
        out[rank] = merged + ([held] if held is not None else [])
    return out


def pairs_of(order: dict, rank: int) -> int:
    """How many OVERLAP_F_B actions `rank` runs in `order`."""
    return sum(a is not None and a.computation_type == ts.OVERLAP_F_B for a in order[rank])


def torch_order(schedule: str, pp: int, m: int, v: int):
    """(stage -> pp rank, {rank: compute-only order}) that torch 2.13 computes for
    pp_schedule `schedule` (1f1b: the interleaved 1F1B's one-stage order, what the overlap
    runs), without stages or a process group: only the attributes its order computation
    reads are set."""
    name = "interleaved_1f1b" if schedule == "1f1b" else schedule
    cls = getattr(ts, SCHEDULES[name].torch_class)
    s = cls.__new__(cls)
    s.pp_group_size, s._n_microbatches, s.n_local_stages = pp, m, v
    s._num_stages = s.num_stages = pp * v
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    style = "v" if SCHEDULES[name].placement == "v" else "loop"
    to_rank = ts.generate_stage_to_rank_mapping(pp, pp * v, style=style)
    s.stage_index_to_group_rank = to_rank
    return to_rank, {r: s._calculate_single_rank_operations(r) for r in range(pp)}


def _lowers(order: dict, to_rank: dict, m: int) -> bool:
    """Whether torch's lowering schedules `order`'s sends and receives (no rank waiting on
    itself)."""
    acts = {r: ts._add_reduce_grad(ts._add_unshard_reshard(a), m) for r, a in order.items()}
    try:
        ts._add_send_recv(acts, stage_to_rank=lambda k: to_rank[k], num_stages=len(to_rank))
    except AssertionError:
        return False
    return True


def _first_lowering(order: dict, lowers):
    """The merged order the overlap runs: pairs in either order, else a forward only with
    the backward after it, whichever `lowers(merged)` accepts first; None if neither."""
    for either in (True, False):
        merged = overlapped_order(order, either)
        if lowers(merged):
            return merged
    return None


def paired_counts(schedule: str, pp: int, m: int, v: int) -> list | None:
    """[pairs pipeline rank r runs] under parallel.a2a_overlap=1f1b (the order
    overlap_schedule picks), or None where no pairing lowers."""
    to_rank, order = torch_order(schedule, pp, m, v)
    merged = _first_lowering(order, lambda o: _lowers(o, to_rank, m))
    return None if merged is None else [pairs_of(merged, r) for r in range(pp)]


def overlap_schedule(schedule, baton):
    """Lower `schedule` (a torch _PipelineScheduleRuntime) again with its forward/backward
    pairs merged, and run each pair through `baton`. Returns the schedule.

    Pairs in either order first (the last stage pairs F(i+1) with B(i), Megatron's combined
    1F1B); where torch's lowering finds that order cannot be scheduled (the zero-bubble
    orders), a forward only with the backward after it. Every rank lowers every rank's order
    the same way, so all agree."""
    def lowers(merged) -> bool:  # the last accepted one stays lowered in the schedule
        try:
            schedule._prepare_schedule_with_comms(merged)
        except AssertionError:  # "Malformed compute schedule, can't schedule sends/recvs"
            return False
        return True

    merged = _first_lowering(schedule.pipeline_order, lowers)
    if merged is not None:
        schedule.pipeline_order = merged
        _drop_pair_sends(schedule.pipeline_order_with_comms)
        sends = []   # the halves' sends, waited for at the end of the step (as torch's are)
        schedule.register_custom_function(
            ts.OVERLAP_F_B, lambda action, ctx: _run_pair(baton, action, ctx, sends))
        run = schedule._step_microbatches

        def step(*args, **kwargs):
            out = run(*args, **kwargs)
            while sends:
                ts._wait_batch_p2p(sends.pop())
            return out
        schedule._step_microbatches = step
        return schedule
    raise ValueError(f"parallel.a2a_overlap=1f1b: no forward/backward pairing of this schedule's "
                     f"{schedule._n_microbatches} microbatches can be ordered without a rank waiting "
                     f"on itself; raise parallel.microbatches (or parallel.a2a_overlap=none)")


def _drop_pair_sends(order_with_comms: dict) -> None:
    """Remove, in every rank's lowered order, the sends of the pairs' halves (each half
    sends its own output as it ends: _forward, _backward)."""
    for rank, actions in order_with_comms.items():
        own = set()
        for a in actions:
            if a is not None and a.computation_type == ts.OVERLAP_F_B:
                f, b = a.sub_actions
                own |= {(ts.SEND_F, f.stage_index, f.microbatch_index),
                        (ts.SEND_B, b.stage_index, b.microbatch_index)}
        order_with_comms[rank] = [a for a in actions if a is None or
                                  (a.computation_type, a.stage_index, a.microbatch_index) not in own]


class _Received:
    """A pipeline receive as the baton waits for it (the other half runs meanwhile)."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        ts._wait_batch_p2p(self.works)


def _run_pair(baton, action, ctx, sends) -> None:
    sched = ctx.schedule_ref
    stages = {s.stage_index: s for s in sched._stages}
    f, b = action.sub_actions
    baton.pair(lambda: _forward(sched, stages, f, ctx, baton, sends),
               lambda: _backward(sched, stages, b, baton, sends))


def _forward(sched, stages, a, ctx, baton, sends) -> None:
    """What the runtime does for RECV_F's wait, FORWARD and SEND_F (or the local hand-over)."""
    stage, mb = stages[a.stage_index], a.microbatch_index
    if not stage.is_first and a.stage_index - 1 not in stages:
        baton.wait(_Received(sched.fwd_recv_ops.pop((a.stage_index, mb))), count=False)
    out = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=True)
    sched._maybe_compute_loss(stage, out, ctx.target_mbs, mb)
    if a.stage_index + 1 in stages:  # the V's two ends on one rank: handed over locally
        stages[a.stage_index + 1].set_local_fwd_input(out, mb)
    elif not stage.is_last:
        sends.append(ts._batch_p2p(stage.get_fwd_send_ops(mb)))


def _backward(sched, stages, a, baton, sends) -> None:
    """What the runtime does for RECV_B's wait, FULL_BACKWARD / BACKWARD_INPUT and SEND_B
    (or the local hand-over)."""
    stage, mb = stages[a.stage_index], a.microbatch_index
    if not stage.is_last and a.stage_index + 1 not in stages:
        baton.wait(_Received(sched.bwd_recv_ops.pop((a.stage_index, mb))), count=False)
    full = a.computation_type == ts.FULL_BACKWARD
    last = False
    if full:  # the runtime counts whole backwards (and weight halves) to find the last one
        sched.backward_counter[a.stage_index] += 1
        last = sched.backward_counter[a.stage_index] == sched._n_microbatches
    stage.backward_one_chunk(mb, loss=sched._maybe_get_loss(stage, mb), full_backward=full,
                             last_backward=last)
    if a.stage_index - 1 in stages:
        stages[a.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
    elif not stage.is_first:
        sends.append(ts._batch_p2p(stage.get_bwd_send_ops(mb)))
