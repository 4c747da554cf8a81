"""Decoding (models/generation.py, the KV cache of models/kv_cache.py) and model-level router
record/replay (moe/replay.py), issue 33 parts 2 and 4.

- A KV-cached forward (prompt, then one token, then a chunk of several) gives the logits of the
  whole-sequence forward at every position: GPT with rotary + grouped-query + qk-norm, with
  learned positions, with MLA, and an HF llama family model (transformers' own cache); fp64,
  1e-10 for ours, 1e-9 for HF's.
- Greedy decoding with the cache equals decoding without it, token for token; the encoder-
  decoder decode equals a greedy loop over the whole forward.
- Sampling: a seed repeats a sample; top-k and top-p keep exactly the hand-computed token set
  with the renormalised probabilities (2000 draws, 4 sigma).
- A recorded KV-cached decode's routing equals the whole-sequence forward's, and after the
  router changes a replayed forward routes to the recorded experts.
"""
import pytest
import torch

import models
from models.config import ModelConfig, MoEConfig
from models.generation import Sampling, generate, generate_seq2seq, next_tokens
from moe.aux import moe_layers
from moe.replay import RoutingRecorder, replaying

V = 61
GPT_VARIANTS = {
    "rope_gqa_qknorm": dict(positions="rope", n_heads=4, n_kv_heads=2, qk_norm=True),
    "learned": dict(positions="learned", n_heads=2),
    "mla": dict(attention="mla", n_heads=2, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                head_dim=8),
}


def _gpt(**kw):
    m = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=kw.pop("n_heads"), d_ff=48,
                    max_seq_len=40, **kw)
    moe_cfg = MoEConfig(num_experts=4, top_k=2, every=1, capacity_factor=None)
    model = models.init_weights(models.build_model(m, moe_cfg), seed=1, device="cpu")
    return model.double().eval()


def _cached_logits(model, ids_BL, cuts=(5, 6, 9)):
    """Logits of ids fed through a cache in pieces [0,5), [5,6), [6,9), [9,L)."""
    cache, out, start = model.new_cache(), [], 0
    for end in (*cuts, ids_BL.shape[1]):
        out.append(model(ids_BL[:, start:end], cache=cache))
        start = end
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("variant", sorted(GPT_VARIANTS))
def test_gpt_kv_cache_equals_whole_forward_and_greedy_tokens(variant):
    model = _gpt(**GPT_VARIANTS[variant])
    ids = torch.randint(1, V, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(_cached_logits(model, ids), model(ids), rtol=1e-10, atol=1e-10)
    g = Sampling(temperature=0)
    cached = generate(model, ids[:, :4], 20, g, use_cache=True)
    full = generate(model, ids[:, :4], 20, g, use_cache=False)
    assert cached.shape == (2, 20) and torch.equal(cached, full)


def test_hf_decoder_cache_equals_whole_forward_and_greedy_tokens():
    from models.hf_build import HFConfig, build_hf_model
    m = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=40)
    moe_cfg = MoEConfig(num_experts=4, top_k=2, every=1, capacity_factor=None)
    model = build_hf_model(HFConfig(family="llama", kv_heads=2), m, moe_cfg, seed=2).double().eval()
    ids = torch.randint(1, V, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(_cached_logits(model, ids), model(ids), rtol=1e-9, atol=1e-9)
    g = Sampling(temperature=0)
    assert torch.equal(generate(model, ids[:, :3], 12, g, use_cache=True),
                       generate(model, ids[:, :3], 12, g, use_cache=False))


def test_seq2seq_decode_equals_greedy_loop_over_whole_forward():
    m = ModelConfig(arch="switch", vocab_size=V, d_model=32, n_layers=2, n_heads=2, d_ff=48,
                    max_seq_len=40)
    moe_cfg = MoEConfig(num_experts=4, top_k=1, every=2, capacity_factor=None)
    model = models.init_weights(models.build_model(m, moe_cfg), seed=3, device="cpu").double().eval()
    src = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(2))
    got = generate_seq2seq(model, src, 8, Sampling(temperature=0))
    tgt = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(8):
            tgt = torch.cat((tgt, model(src, tgt)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(got, tgt[:, 1:])


def test_eos_stops_a_row_and_the_batch():
    model = _gpt(**GPT_VARIANTS["learned"])
    prompt = torch.randint(1, V, (1, 4), generator=torch.Generator().manual_seed(3))
    free = generate(model, prompt, 10, Sampling(temperature=0))
    eos = int(free[0, 2])  # the third greedy token, taken as end-of-text
    stopped = generate(model, prompt, 10, Sampling(temperature=0), eos_id=eos)
    first = free[0].tolist().index(eos)
    assert stopped[0].tolist() == free[0, :first + 1].tolist()


def test_sampling_repeats_by_seed_and_differs_across_seeds():
    model = _gpt(**GPT_VARIANTS["learned"])
    prompt = torch.randint(1, V, (3, 4), generator=torch.Generator().manual_seed(4))
    s = Sampling(temperature=1.0, top_k=20, top_p=0.95)
    draw = lambda seed: generate(model, prompt, 15, s, torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


@pytest.mark.parametrize("sampling,kept", [
    (Sampling(temperature=1.0, top_k=2), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    (Sampling(temperature=1.0, top_p=0.6), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    (Sampling(temperature=1.0, top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    (Sampling(temperature=1.0, top_k=1), [1, 0, 0, 0]),
])
def test_top_k_and_top_p_keep_the_hand_computed_set(sampling, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    n = 2000
    logits = probs.log()[[1, 0, 3, 2]].expand(n, 4)  # shuffled: token 1 is the likeliest
    draws = next_tokens(logits, sampling, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).double()[[1, 0, 3, 2]] / n
    want = torch.tensor(kept, dtype=torch.float64)
    assert torch.all(freq[want == 0] == 0), freq
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((freq - want).abs() <= 4 * sigma + 1e-12), (freq, want)


def test_greedy_and_bad_sampling_settings():
    logits = torch.tensor([[0.1, 2.0, -1.0]])
    assert next_tokens(logits, Sampling(temperature=0)).tolist() == [1]
    for bad, word in ((Sampling(temperature=-1), "temperature"), (Sampling(top_k=-1), "top-k"),
                      (Sampling(top_p=0), "top-p"), (Sampling(top_p=1.5), "top-p")):
        with pytest.raises(ValueError, match=word):
            bad.check()


def test_recorded_decode_routing_replays_after_the_router_moves():
    model = _gpt(**GPT_VARIANTS["rope_gqa_qknorm"])
    prompt = torch.randint(1, V, (2, 5), generator=torch.Generator().manual_seed(5))
    with RoutingRecorder(model) as rec:
        new = generate(model, prompt, 9, Sampling(temperature=0))
    ids = rec.ids()
    seq = torch.cat((prompt, new), dim=1)[:, :-1]          # the positions that were fed
    assert ids.shape == (2, len(moe_layers(model)), seq.shape[1], 2)
    with RoutingRecorder(model) as whole, torch.no_grad():
        model(seq)
    assert torch.equal(whole.ids(), ids)                   # cached decode routes as the whole pass
    with torch.no_grad():
        for _, layer in moe_layers(model):
            layer.router.weight.add_(torch.randn_like(layer.router.weight))
    with RoutingRecorder(model) as moved, torch.no_grad():
        model(seq)
    assert not torch.equal(moved.ids(), ids)               # the router now chooses otherwise
    with RoutingRecorder(model) as replayed, replaying(model, ids), torch.no_grad():
        model(seq)
    assert torch.equal(replayed.ids(), ids)
    with pytest.raises(ValueError, match="MoE layers"):
        with replaying(model, ids[:, :1]):
            pass
