"""Pipeline schedules: bubble fraction and how many micro-batches a stage keeps in flight.

p pipeline ranks, m micro-batches, v model chunks per rank (interleaved 1F1B), stage s
(0 = first). Per optimizer step every rank runs m forward and m backward passes of its
chunk(s); the fill and drain leave each rank idle for (p-1) micro-batch slots (GPipe and
1F1B), or (p-1)/v of them when each slot is a 1/v chunk (interleaved; Narayanan et al. 2021):
  bubble fraction (idle / step time) = (p-1) / (m + p - 1)          gpipe, 1f1b
                                     = (p-1) / (v*m + p - 1)        interleaved_1f1b
Activations alive at the peak (in units of one micro-batch through one chunk):
  gpipe: m * v (all forwards before any backward)
  1f1b: min(m, p - s) (warm-up forwards of stage s)
  interleaved_1f1b: min(m*v, 2*(p - s - 1) + (v - 1)*p + 1) (torch's warm-up count + 1)
"""


def bubble_fraction(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    if pp <= 1:
        return 0.0
    v = chunks if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def in_flight(schedule: str, pp: int, microbatches: int, stage: int, chunks: int = 1) -> int:
    """Micro-batch-chunks whose activations a pipeline rank holds at once (1 without pp)."""
    if pp <= 1:
        return 1
    m = microbatches
    if schedule == "gpipe":
        return m * chunks
    if schedule == "1f1b":
        return min(m, pp - stage)
    return min(m * chunks, 2 * (pp - stage - 1) + (chunks - 1) * pp + 1)
