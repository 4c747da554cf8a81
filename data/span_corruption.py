"""T5 span corruption as pure functions over token arrays, deterministic from a seed.

A raw sequence of L tokens is split into alternating kept / noise spans (starting with a kept
span). round(L * noise_density) tokens are noise, in round(noise / mean_span_length) spans
with random lengths. The encoder input keeps the kept spans and replaces noise span i by
sentinel i; the target lists, for each noise span i, sentinel i then the span's tokens:
    raw      a b c d e f g h         (noise: c d, g)
    inputs   a b <s0> e f <s1> h
    labels   <s0> c d <s1> g
Sentinel i has id `sentinel_start - i` (default vocab_size - 1 - i, as T5's extra ids), so
real tokens must stay below the sentinels in use. The output lengths depend only on L (not
on the random draw), so equal-length raw rows give equal-length outputs without padding;
`raw_length_for` picks L for a wanted encoder length.
"""
import numpy as np

IGNORE_INDEX = -100


def _num_noise_and_spans(length: int, noise_density: float, mean_span_length: float):
    num_noise = int(round(length * noise_density))
    num_noise = min(max(num_noise, 1), length - 1)
    num_spans = max(1, int(round(num_noise / mean_span_length)))
    return num_noise, min(num_spans, num_noise, length - num_noise)


def corrupted_lengths(length: int, noise_density: float = 0.15, mean_span_length: float = 3.0,
                      eos: bool = False) -> tuple:
    """(encoder input length, target length) for a raw sequence of `length` tokens."""
    num_noise, num_spans = _num_noise_and_spans(length, noise_density, mean_span_length)
    return length - num_noise + num_spans + eos, num_noise + num_spans + eos


def raw_length_for(inputs_length: int, noise_density: float = 0.15, mean_span_length: float = 3.0,
                   eos: bool = False) -> tuple:
    """Largest raw length whose corrupted input fits in `inputs_length`; -> (raw, targets)."""
    raw = inputs_length
    while corrupted_lengths(raw + 1, noise_density, mean_span_length, eos)[0] <= inputs_length:
        raw += 1
    while raw > 2 and corrupted_lengths(raw, noise_density, mean_span_length, eos)[0] > inputs_length:
        raw -= 1
    return raw, corrupted_lengths(raw, noise_density, mean_span_length, eos)[1]


def _random_segmentation(total: int, num_segments: int, rng) -> np.ndarray:
    """num_segments positive lengths summing to total, uniformly over all such splits."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=num_segments - 1, replace=False))
    return np.diff(np.concatenate(([0], cuts, [total])))


def noise_mask(length: int, noise_density: float, mean_span_length: float, rng) -> np.ndarray:
    """Bool [length]: True on noise tokens; spans alternate kept/noise, starting kept."""
    if length < 2:
        raise ValueError(f"span corruption needs at least 2 tokens, got length={length}")
    num_noise, num_spans = _num_noise_and_spans(length, noise_density, mean_span_length)
    noise_lens = _random_segmentation(num_noise, num_spans, rng)
    keep_lens = _random_segmentation(length - num_noise, num_spans, rng)
    span_lens = np.stack([keep_lens, noise_lens], axis=1).reshape(-1)
    span_is_noise = np.tile([False, True], num_spans)
    return np.repeat(span_is_noise, span_lens)


def _check_args(noise_density, mean_span_length, vocab_size, sentinel_start):
    if not 0.0 < noise_density < 1.0:
        raise ValueError(f"noise_density={noise_density} must be in (0, 1), e.g. 0.15")
    if not mean_span_length >= 1.0:
        raise ValueError(f"mean_span_length={mean_span_length} must be >= 1, e.g. 3.0")
    if sentinel_start is None and vocab_size is None:
        raise ValueError("give vocab_size (sentinels are vocab_size-1, vocab_size-2, ...) "
                         "or sentinel_start")


def span_corrupt(tokens, seed, *, vocab_size=None, noise_density: float = 0.15,
                 mean_span_length: float = 3.0, sentinel_start=None, eos_id=None,
                 decoder_start_id: int = 0) -> dict:
    """One raw token sequence -> {"input_ids", "labels", "decoder_input_ids"} (int64 arrays).

    `seed` is an int or a sequence of ints (e.g. (seed, global_sample_index)). With eos_id,
    EOS ends both inputs and labels. decoder_input_ids = labels shifted right, starting with
    decoder_start_id (T5 uses the pad id, 0).
    """
    _check_args(noise_density, mean_span_length, vocab_size, sentinel_start)
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    top = vocab_size - 1 if sentinel_start is None else sentinel_start
    rng = np.random.default_rng(seed)
    mask = noise_mask(len(tokens), noise_density, mean_span_length, rng)
    starts = mask & ~np.concatenate(([False], mask[:-1]))  # first token of each noise span
    span_id = np.cumsum(starts) - 1                          # noise span index per token
    num_spans = int(starts.sum())
    lowest = top - num_spans + 1
    if lowest < 0 or tokens.max(initial=-1) >= lowest or tokens.min(initial=0) < 0:
        raise ValueError(f"token ids must lie in [0, {lowest}) to stay below the {num_spans} sentinel "
                         f"ids {lowest}..{top}; enlarge vocab_size (or sentinel_start) to reserve them")
    sentinels = top - span_id
    keep_in = ~mask | starts
    input_ids = np.where(starts, sentinels, tokens)[keep_in]
    # targets: before each span's first token insert its sentinel
    tgt_pos = np.flatnonzero(mask)
    labels = np.insert(tokens[tgt_pos], np.flatnonzero(starts[tgt_pos]), top - np.arange(num_spans))
    if eos_id is not None:
        input_ids, labels = np.append(input_ids, eos_id), np.append(labels, eos_id)
    decoder_input_ids = np.concatenate(([decoder_start_id], labels[:-1]))
    return {"input_ids": input_ids, "labels": labels, "decoder_input_ids": decoder_input_ids}


def span_corrupt_batch(rows, seed: int, *, row_ids=None, pad_id: int = 0, **kwargs) -> dict:
    """Corrupt each row with its own stream (seed, row_id) and pad into [B, *] int64 arrays.

    row_ids (default 0..B-1) should be global sample indices so the result does not depend
    on how a batch is split over data-parallel ranks. Padding: input_ids / decoder_input_ids
    with pad_id, labels with -100; attention_mask is 1 on real encoder tokens.
    """
    row_ids = range(len(rows)) if row_ids is None else row_ids
    outs = [span_corrupt(r, (seed, int(i)), **kwargs) for r, i in zip(rows, row_ids)]
    batch = {}
    for key, fill in (("input_ids", pad_id), ("labels", IGNORE_INDEX), ("decoder_input_ids", pad_id)):
        width = max(len(o[key]) for o in outs)
        arr = np.full((len(outs), width), fill, dtype=np.int64)
        for b, o in enumerate(outs):
            arr[b, :len(o[key])] = o[key]
        batch[key] = arr
    mask = np.zeros(batch["input_ids"].shape, dtype=np.int64)
    for b, o in enumerate(outs):
        mask[b, :len(o["input_ids"])] = 1
    batch["attention_mask"] = mask
    return batch


def reconstruct(input_ids, labels, sentinel_start: int, eos_id=None) -> np.ndarray:
    """Inverse of span_corrupt on one unpadded row: put each sentinel's target tokens back."""
    input_ids = [int(t) for t in input_ids]
    labels = [int(t) for t in labels if t != IGNORE_INDEX]
    if eos_id is not None:  # only the final EOS; raw text may contain the same id
        input_ids, labels = input_ids[:-1], labels[:-1]
    spans = {}
    for t in labels:  # sentinels come in order sentinel_start, sentinel_start - 1, ...
        if t == sentinel_start - len(spans):
            spans[t] = []
        else:
            spans[sentinel_start - len(spans) + 1].append(t)
    out = []
    for t in input_ids:
        out.extend(spans[t] if t in spans else [t])
    return np.asarray(out, dtype=np.int64)
