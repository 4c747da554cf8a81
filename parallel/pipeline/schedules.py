"""Pipeline schedules: the one table of what each schedule is, where its stages sit, its
bubble and the activations it keeps in flight. plan.py (validation), mesh.py (the tied
embedding's stage pair), the runners and the planner all read it.

Placement of stage k of n = pp * v (v = stages per rank) on pipeline rank r:
  one:    v = 1, stage r                                     (gpipe, 1f1b, 2bw)
  looped: stages r, r+pp, ..., r+(v-1)pp                     (interleaved_1f1b, zb_interleaved)
  v:      stages r and 2pp-1-r, so rank 0 holds both ends    (zbv, dualpipev)

p pipeline ranks, m micro-batches, v model chunks per rank (interleaved 1F1B), stage s
(0 = first). Per optimizer step every rank runs m forward and m backward passes of its
chunk(s); the fill and drain leave each rank idle for (p-1) micro-batch slots (GPipe and
1F1B), or (p-1)/v of them when each slot is a 1/v chunk (interleaved; Narayanan et al. 2021):
  bubble fraction (idle / step time) = (p-1) / (m + p - 1)          gpipe, 1f1b
                                     = (p-1) / (v*m + p - 1)        interleaved_1f1b
The zero-bubble schedules split each backward into B (input gradient) and W (weight
gradient) and fill the fill/drain slots with W; with T_F = T_B = T_W (each a third of a
chunk's forward+backward; Qi et al. 2024's equal-time assumption):
  zb_interleaved: idle (p-1)/3 chunk slots (ZB-H1's third of 1F1B's) -> (p-1) / (3*v*m + p - 1)
  zbv, dualpipev: 0 (ZB-V, and DeepSeek-V3's DualPipe bubble (p/2-1)(F&B + B - 3W), vanish at
                  equal times; real T_W < T_B leaves some, which bench/pipeline_bubble.py measures)
PipeDream-2BW (2bw) never flushes: the micro-batches of consecutive steps keep the pipeline
full. What is left is the training loop's per-step barrier (the loss, gradient-norm and
agreement all-reduces): stage s runs s forward slots behind stage 0, so each step every stage
waits (p-1) forward passes, T_F = (T_F + T_B)/3 at T_B = 2 T_F:
  2bw: (p-1) / (3*m + p - 1)        (1F1B's fill and drain, forward passes only)
(the fill at the start and at each drain before evaluation or a checkpoint not counted).
It is not the synchronous function: each update uses the gradient of the previous weights.
Activations alive at the peak (in units of one micro-batch through one chunk):
  gpipe: m * v (all forwards before any backward)
  1f1b, 2bw: min(m, p - s) (warm-up forwards of stage s)
  interleaved_1f1b, zb_interleaved: min(m*v, 2*(p - s - 1) + (v - 1)*p + 1) (torch's warm-up
      count + 1)
  zbv, dualpipev: min(2m, 2p) (p micro-batches of both chunks: 1F1B's peak, Qi et al. 2024)
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    torch_class: str | None    # torch.distributed.pipelining class (None: moekit's own runner)
    placement: str             # "one" | "looped" | "v" (see the module docstring)
    zero_bubble: bool = False  # backward split into input then weight gradient
    asynchronous: bool = False # no flush between steps, delayed update (PipeDream-2BW)


SCHEDULES = {
    "1f1b": Schedule("Schedule1F1B", "one"),
    "gpipe": Schedule("ScheduleGPipe", "one"),
    "interleaved_1f1b": Schedule("ScheduleInterleaved1F1B", "looped"),
    "zb_interleaved": Schedule("ScheduleInterleavedZeroBubble", "looped", zero_bubble=True),
    "zbv": Schedule("ScheduleZBVZeroBubble", "v", zero_bubble=True),
    "dualpipev": Schedule("ScheduleDualPipeV", "v", zero_bubble=True),
    "2bw": Schedule(None, "one", asynchronous=True),
}
PP_SCHEDULES = tuple(SCHEDULES)
ASYNC_SCHEDULES = tuple(k for k, s in SCHEDULES.items() if s.asynchronous)
LOOPED_SCHEDULES = tuple(k for k, s in SCHEDULES.items() if s.placement == "looped")
V_SCHEDULES = tuple(k for k, s in SCHEDULES.items() if s.placement == "v")
MULTI_STAGE_SCHEDULES = LOOPED_SCHEDULES + V_SCHEDULES
ZERO_BUBBLE = tuple(k for k, s in SCHEDULES.items() if s.zero_bubble)


def stage_ids(schedule: str, pp: int, stages_per_rank: int, pp_rank: int) -> list:
    """The stages pipeline rank `pp_rank` runs, in order (see the placements above)."""
    if SCHEDULES[schedule].placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stage_owner(schedule: str, pp: int, stages_per_rank: int) -> dict:
    """{stage: pipeline rank}."""
    return {k: r for r in range(pp) for k in stage_ids(schedule, pp, stages_per_rank, r)}


def bubble_fraction(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    if pp <= 1:
        return 0.0
    if SCHEDULES[schedule].placement == "v":
        return 0.0
    if schedule == "2bw":
        return (pp - 1) / (3 * microbatches + pp - 1)
    v = chunks if SCHEDULES[schedule].placement == "looped" else 1
    if schedule == "zb_interleaved":
        return (pp - 1) / (3 * v * microbatches + pp - 1)
    return (pp - 1) / (v * microbatches + pp - 1)


def in_flight(schedule: str, pp: int, microbatches: int, stage: int, chunks: int = 1) -> int:
    """Micro-batch-chunks whose activations a pipeline rank holds at once (1 without pp)."""
    if pp <= 1:
        return 1
    m = microbatches
    if schedule == "gpipe":
        return m * chunks
    if schedule in ("1f1b", "2bw"):
        return min(m, pp - stage)
    if SCHEDULES[schedule].placement == "v":
        return min(2 * m, 2 * pp)
    return min(m * chunks, 2 * (pp - stage - 1) + (chunks - 1) * pp + 1)
