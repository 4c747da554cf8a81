"""Pipeline schedules: bubble fraction and how many micro-batches a stage keeps in flight.

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
from ..plan import LOOPED_SCHEDULES, V_SCHEDULES


def bubble_fraction(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    if pp <= 1:
        return 0.0
    if schedule in V_SCHEDULES:
        return 0.0
    if schedule == "2bw":
        return (pp - 1) / (3 * microbatches + pp - 1)
    v = chunks if schedule in LOOPED_SCHEDULES else 1
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
    if schedule in V_SCHEDULES:
        return min(2 * m, 2 * pp)
    return min(m * chunks, 2 * (pp - stage - 1) + (chunks - 1) * pp + 1)
