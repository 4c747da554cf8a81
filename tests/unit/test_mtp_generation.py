"""Self-speculative decoding with the MTP depth (models/generation.generate_mtp_speculative)
gives exactly the tokens of plain greedy decoding.

A random tiny MoE GPT with model.mtp_depth=1 decodes 24 tokens both ways. Its own drafts are
checked, and then drafts forced right on every other step and wrong on the others (the real
draft still runs, so the MTP cache advances as it would): both the accepted path (two tokens
per main forward) and the rejected one (the draft's position dropped from the KV cache) must
keep the output identical, and the counts must say which happened.
"""
import pytest
import torch

import models.generation as gen
from models.build import build_model, init_weights
from models.config import ModelConfig, MoEConfig
from models.generation import Sampling, Speculation, generate, generate_mtp_speculative


def _model():
    # init_std 0.3: the context moves the greedy token (at 0.02 a random model mostly
    # repeats what its input embedding says, and a stale cache entry would go unseen)
    m = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64,
                    mtp_depth=1, init_std=0.3).validate()
    e = MoEConfig(num_experts=4, top_k=2, every=2).validate(m)
    return init_weights(build_model(m, e, device="cpu"), seed=5).double().eval()


PROMPT = torch.tensor([[3, 17, 5, 9, 30, 2, 11]])


def test_own_drafts_give_the_greedy_tokens():
    model = _model()
    want = generate(model, PROMPT, 24, Sampling(temperature=0.0))
    stats = Speculation()
    got = generate_mtp_speculative(model, PROMPT, 24, stats=stats)
    assert torch.equal(got, want)
    assert stats.drafted > 0 and 0 <= stats.accepted <= stats.drafted


@pytest.mark.parametrize("eos", [None, "third"])
def test_forced_right_and_wrong_drafts_keep_the_greedy_tokens(monkeypatch, eos):
    model = _model()
    want = generate(model, PROMPT, 24, Sampling(temperature=0.0))[0]
    eos_id = None if eos is None else int(want[2])
    if eos_id is not None:
        want = generate(model, PROMPT, 24, Sampling(temperature=0.0), eos_id=eos_id)[0]
    full = torch.cat([PROMPT[0], want])
    real, calls = gen._draft, []

    def forced(model_, depth, mtp_cache, h, nxt):
        real(model_, depth, mtp_cache, h, nxt)  # the MTP cache advances as it would
        calls.append(None)
        n = mtp_cache.length  # the draft is for token n + 1 (positions < n cached)
        right = full[n + 1] if n + 1 < len(full) else torch.tensor(0)
        return (right if len(calls) % 2 else (right + 1) % 48).reshape(1, 1)
    monkeypatch.setattr(gen, "_draft", forced)
    stats = Speculation()
    got = generate_mtp_speculative(model, PROMPT, 24, eos_id=eos_id, stats=stats)
    assert torch.equal(got[0], want)
    if eos is None:  # both paths taken, in turn
        assert stats.accepted >= 3 and stats.drafted - stats.accepted >= 3, stats
