"""T5 span corruption: determinism, statistics, sentinels, reconstruction, lengths, batching."""
import numpy as np
import pytest

from data.span_corruption import (IGNORE_INDEX, corrupted_lengths, raw_length_for, reconstruct,
                                  span_corrupt, span_corrupt_batch)

V = 1000  # sentinels 999, 998, ...; raw tokens below 900


def _row(n, seed=0):
    return np.random.default_rng(seed).integers(0, 900, size=n)


def test_deterministic_from_seed():
    toks = _row(200)
    a, b = span_corrupt(toks, 7, vocab_size=V), span_corrupt(toks, 7, vocab_size=V)
    c = span_corrupt(toks, 8, vocab_size=V)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["input_ids"], c["input_ids"])


def test_noise_density_and_mean_span_length():
    density, span = 0.15, 3.0
    noise, spans, total = 0, 0, 0
    for i in range(50):
        toks = _row(400, i)
        out = span_corrupt(toks, (1, i), vocab_size=V, noise_density=density, mean_span_length=span)
        n_spans = int((out["labels"] >= 900).sum())
        noise += len(out["labels"]) - n_spans
        spans += n_spans
        total += len(toks)
    # noise count is round(L * density) per row, exactly; the span count round(noise / span)
    assert noise == 50 * round(400 * density)
    assert abs(noise / spans - span) < 0.1, noise / spans


def test_sentinels_and_reconstruction():
    toks = _row(300, 3)
    out = span_corrupt(toks, 5, vocab_size=V, eos_id=1)
    inp, lab = out["input_ids"], out["labels"]
    sent_in, sent_lab = inp[inp >= 900], lab[lab >= 900]
    n = len(sent_in)
    assert n >= 10
    np.testing.assert_array_equal(sent_in, V - 1 - np.arange(n))   # in order, counting down
    np.testing.assert_array_equal(sent_lab, V - 1 - np.arange(n))
    assert lab[0] == V - 1 and inp[-1] == 1 and lab[-1] == 1       # labels start with <s0>, EOS ends
    np.testing.assert_array_equal(out["decoder_input_ids"], np.concatenate(([0], lab[:-1])))
    np.testing.assert_array_equal(reconstruct(inp, lab, V - 1, eos_id=1), toks)
    # custom sentinel range below the vocab top
    out2 = span_corrupt(toks, 5, sentinel_start=950)
    assert out2["labels"][0] == 950
    np.testing.assert_array_equal(reconstruct(out2["input_ids"], out2["labels"], 950), toks)


def test_lengths_fixed_and_raw_length_for():
    for L in (10, 57, 128, 513):
        out = span_corrupt(_row(L), 0, vocab_size=V, eos_id=1)
        assert (len(out["input_ids"]), len(out["labels"])) == corrupted_lengths(L, eos=True)
    raw, tgt = raw_length_for(128, eos=True)
    assert corrupted_lengths(raw, eos=True) == (128, tgt)
    assert corrupted_lengths(raw + 1, eos=True)[0] > 128


def test_batch_padding_and_row_ids():
    rows = [_row(60, 1), _row(40, 2)]
    batch = span_corrupt_batch(rows, 11, row_ids=[5, 9], vocab_size=V, eos_id=1, pad_id=0)
    for b, (row, rid) in enumerate(zip(rows, [5, 9])):
        single = span_corrupt(row, (11, rid), vocab_size=V, eos_id=1)
        n_in, n_lab = len(single["input_ids"]), len(single["labels"])
        np.testing.assert_array_equal(batch["input_ids"][b, :n_in], single["input_ids"])
        np.testing.assert_array_equal(batch["labels"][b, :n_lab], single["labels"])
        assert (batch["labels"][b, n_lab:] == IGNORE_INDEX).all()
        assert (batch["input_ids"][b, n_in:] == 0).all()
        assert batch["attention_mask"][b].sum() == n_in
    assert batch["input_ids"].dtype == np.int64


def test_bad_input_errors():
    with pytest.raises(ValueError, match="sentinel"):
        span_corrupt(np.array([5, 999, 3, 4]), 0, vocab_size=V)
    with pytest.raises(ValueError, match="noise_density"):
        span_corrupt(_row(10), 0, vocab_size=V, noise_density=1.5)
    with pytest.raises(ValueError, match="vocab_size"):
        span_corrupt(_row(10), 0)
    with pytest.raises(ValueError, match="at least 2"):
        span_corrupt(np.array([3]), 0, vocab_size=V)
