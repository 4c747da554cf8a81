"""GPT and Switch models: shapes, MoE placement, causality, tying, deterministic init, counts.

Tiny configs (D=8..32) so the whole file runs in seconds on one CPU core.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import models
import models.build as build
from data.span_corruption import span_corrupt_batch
from moe import DenseFFN, MoELayer
from models import ModelConfig, MoEConfig, build_model, count_params, init_weights, moe_layers


def tiny(arch="gpt", **kw):
    base = dict(arch=arch, vocab_size=16, d_model=8, n_layers=2, n_heads=2, d_ff=12,
                max_seq_len=32, rel_pos_buckets=4, rel_pos_max_distance=8)
    return ModelConfig(**{**base, **kw})


def tiny_moe(**kw):
    return MoEConfig(**{**dict(num_experts=4, top_k=2, every=2), **kw})


def make(model_cfg, moe_cfg, seed=0):
    return init_weights(build_model(model_cfg, moe_cfg), seed, "cpu")


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_shapes_gpt_and_switch():
    ids = torch.randint(0, 16, (3, 10))
    for pos in ("rope", "learned"):
        gpt = make(tiny(positions=pos), tiny_moe())
        assert gpt(ids).shape == (3, 10, 16)
        assert (gpt.pos_emb is None) == (pos == "rope")
    sw = make(tiny("switch"), tiny_moe())
    assert sw(ids, ids[:, :6]).shape == (3, 6, 16)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, 7:] = 0
    assert sw(ids, ids[:, :6], mask).isfinite().all()
    with pytest.raises(ValueError, match="max_seq_len"):
        gpt(torch.zeros(1, 33, dtype=torch.long))
    # MoE variants the configs expose: all run and give finite logits and aux losses
    for moe_kw in (dict(router="expert_choice", capacity_factor=1.0), dict(num_shared_experts=1),
                   dict(capacity_factor=1.0, jitter=0.01, d_ff=6)):
        m = make(tiny(activation="swiglu"), tiny_moe(**moe_kw))
        assert m(ids).isfinite().all(), moe_kw
        assert all(layer.aux_loss.isfinite() for _, layer in moe_layers(m))


def test_every_k_placement():
    def kinds(model_cfg, moe_cfg, blocks_of=lambda m: m.blocks):
        m = build_model(model_cfg, moe_cfg)
        return [i for i, b in enumerate(blocks_of(m)) if isinstance(b.ffn, MoELayer)]
    assert kinds(tiny(n_layers=4), tiny_moe(every=2)) == [1, 3]
    assert kinds(tiny(n_layers=6), tiny_moe(every=3)) == [2, 5]
    assert kinds(tiny(n_layers=4), tiny_moe(every=1, first_moe_layer=2)) == [2, 3]
    dense = build_model(tiny(n_layers=3), tiny_moe(every=0))
    assert moe_layers(dense) == [] and all(isinstance(b.ffn, DenseFFN) for b in dense.blocks)
    sw = tiny("switch", n_layers=4)
    assert kinds(sw, tiny_moe(), lambda m: m.encoder.blocks) == [1, 3]
    assert kinds(sw, tiny_moe(), lambda m: m.decoder.blocks) == [1, 3]
    names = [n for n, _ in moe_layers(build_model(sw, tiny_moe()))]
    assert names == ["encoder.blocks.1.ffn", "encoder.blocks.3.ffn",
                     "decoder.blocks.1.ffn", "decoder.blocks.3.ffn"]
    with pytest.raises(ValueError, match="moe.every"):
        build_model(tiny(n_layers=2), tiny_moe(every=3))


def test_causal_masking():
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (2, 12))
    ids2 = ids.clone()
    ids2[:, 7] = (ids2[:, 7] + 5) % 16
    # dropless: with a capacity limit, later tokens may take an earlier token's expert slot
    for pos in ("rope", "learned"):
        gpt = make(tiny(positions=pos), tiny_moe(capacity_factor=None)).eval()
        a, b = gpt(ids), gpt(ids2)
        torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
        assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4  # the change is seen from 7 on
    sw = make(tiny("switch"), tiny_moe()).eval()
    a, b = sw(ids, ids), sw(ids, ids2)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4
    # the encoder is bidirectional: a late encoder token changes every decoder position
    assert (sw(ids2, ids)[:, 0] - a[:, 0]).abs().max() > 1e-4


def test_tied_embeddings_share_storage():
    for arch in ("gpt", "switch"):
        m = make(tiny(arch, tie_embeddings=True), tiny_moe())
        assert m.lm_head.weight is m.tok_emb.weight
        assert m.lm_head.weight.data_ptr() == m.tok_emb.weight.data_ptr()
        u = make(tiny(arch, tie_embeddings=False), tiny_moe())
        assert u.lm_head.weight.data_ptr() != u.tok_emb.weight.data_ptr()
        assert not torch.equal(u.lm_head.weight, u.tok_emb.weight)


def test_init_deterministic_and_seed_dependent():
    cfg, moe_cfg = tiny(n_layers=4), tiny_moe()
    rng_before = torch.get_rng_state()
    a = state(make(cfg, moe_cfg, seed=3))
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global stream is untouched
    torch.randn(1000)                                      # whatever happens before
    b = state(make(cfg, moe_cfg, seed=3))
    c = state(make(cfg, moe_cfg, seed=4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    weights = [k for k in a if a[k].dim() >= 2]
    assert all(not torch.equal(a[k], c[k]) for k in weights)
    # every weight matrix gets its own stream: no two tensors share values (lm_head is tied)
    firsts = [tuple(a[k].flatten()[:4].tolist()) for k in weights if k != "lm_head.weight"]
    assert len(set(firsts)) == len(firsts)
    # std and norms as configured: N(0, 0.02), output projections / sqrt(2 * n_layers), norms 1
    full = make(tiny(d_model=32, d_ff=64, n_layers=2), tiny_moe())
    assert abs(full.blocks[0].attn.wq.weight.std().item() - 0.02) < 0.003
    assert abs(full.blocks[0].attn.wo.weight.std().item() - 0.01) < 0.0015
    assert abs(full.blocks[1].ffn.experts.w2.std().item() - 0.01) < 0.0015
    assert torch.equal(full.norm.weight, torch.ones(32))
    assert torch.equal(full.blocks[1].ffn.router.selection_bias, torch.zeros(4))


def test_init_invariant_to_pipeline_split_and_expert_sharding(monkeypatch):
    cfg, moe_cfg = tiny(n_layers=4), tiny_moe()
    ref = make(cfg, moe_cfg, seed=1)
    # pipeline stage holding blocks 2..3: names change, init must not
    stage = build_model(cfg, moe_cfg)
    stage.blocks = torch.nn.ModuleList(list(stage.blocks)[2:])
    stage.tok_emb = None
    init_weights(stage, 1, "cpu")
    for i in range(2):
        for (n, p), (_, q) in zip(stage.blocks[i].named_parameters(), ref.blocks[i + 2].named_parameters()):
            assert torch.equal(p, q), n
    # expert-parallel rank 1 of 2: keeps experts [2, 4) of each layer, as B's sharding does
    sharded = build_model(cfg, moe_cfg)
    for _, layer in moe_layers(sharded):
        for p in layer.experts.parameters():
            p.data = p.data[2:4].clone()
    monkeypatch.setattr(build, "_expert_offset", lambda layer: 2)
    init_weights(sharded, 1, "cpu")
    for (n, layer), (_, full) in zip(moe_layers(sharded), moe_layers(ref)):
        assert torch.equal(layer.experts.w1, full.experts.w1[2:4]), n
        assert torch.equal(layer.experts.w2, full.experts.w2[2:4]), n
        assert torch.equal(layer.router.weight, full.router.weight), n
    assert count_params(sharded) == count_params(ref)


def test_param_counts_hand_computed():
    # V=16 D=8 F=12 H=2 E=4 K=2, 2 blocks, MoE in block 1. attention 4*D*D=256, norms D=8,
    # one FFN (gelu) D*F + F*D = 192, router E*D = 32, embedding V*D = 128.
    gpt = build_model(tiny(), tiny_moe())
    total = 128 + 2 * (8 + 256 + 8) + 192 + 32 + 4 * 192 + 8
    assert count_params(gpt) == {"total": total, "active_per_token": total - 2 * 192}
    untied = build_model(tiny(tie_embeddings=False), tiny_moe())
    assert count_params(untied)["total"] == total + 128
    swiglu = build_model(tiny(activation="swiglu"), tiny_moe())  # w3 adds D*F per FFN
    total_sw = total + 96 + 4 * 96
    assert count_params(swiglu) == {"total": total_sw, "active_per_token": total_sw - 2 * 288}
    learned = build_model(tiny(positions="learned"), tiny_moe())  # max_seq_len * D
    assert count_params(learned)["total"] == total + 32 * 8
    # switch: rel bias U*H = 8 per stack; decoder blocks add cross attention + its norm
    sw = build_model(tiny("switch"), tiny_moe())
    enc = 8 + 2 * (8 + 256 + 8) + 192 + 32 + 4 * 192 + 8
    dec = 8 + 2 * (8 + 256 + 8 + 8 + 256) + 192 + 32 + 4 * 192 + 8
    assert count_params(sw) == {"total": 128 + enc + dec, "active_per_token": 128 + enc + dec - 4 * 192}


def test_switch_trains_on_span_corruption():
    torch.manual_seed(0)
    cfg = tiny("switch", vocab_size=64, d_model=16, d_ff=32)
    model = make(cfg, tiny_moe(capacity_factor=1.5), seed=0).train()
    rows = np.random.default_rng(0).integers(2, 50, size=(4, 24))
    batch = {k: torch.from_numpy(v) for k, v in
             span_corrupt_batch(rows, 0, vocab_size=64, eos_id=1).items()}
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(16):
        logits = model(batch["input_ids"], batch["decoder_input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        aux = sum(layer.aux_loss for _, layer in moe_layers(model))
        opt.zero_grad()
        (loss + aux).backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_dropout_only_in_training():
    ids = torch.randint(0, 16, (2, 8))
    gpt = make(tiny(dropout=0.5), tiny_moe())
    assert not torch.equal(gpt.train()(ids), gpt(ids))
    assert torch.equal(gpt.eval()(ids), gpt(ids))


def test_config_errors_and_capacity_spellings():
    with pytest.raises(ValueError, match="model.n_heads"):
        ModelConfig(d_model=10, n_heads=3).validate()
    with pytest.raises(ValueError, match="model.arch"):
        ModelConfig(arch="bert").validate()
    with pytest.raises(ValueError, match="model.norm"):
        ModelConfig(arch="switch", norm="layernorm").validate()
    with pytest.raises(ValueError, match="moe.top_k"):
        MoEConfig(num_experts=4, top_k=5).validate()
    with pytest.raises(ValueError, match="moe.capacity_factor"):
        MoEConfig(capacity_factor=-1).validate()
    for dropless in (None, 0, 0.0, "none", "None", "dropless"):
        assert MoEConfig(capacity_factor=dropless).validate().capacity_factor is None
    cfg = MoEConfig(capacity_factor=1.25)
    assert cfg.validate().resolved_eval_capacity_factor == 1.25
    cfg.eval_capacity_factor = "none"  # set after construction, as a config override would
    assert cfg.validate().resolved_eval_capacity_factor is None
    layer = moe_layers(build_model(tiny(), MoEConfig(num_experts=4, capacity_factor=1.0,
                                                     eval_capacity_factor=2.0)))[0][1]
    assert (layer.capacity_factor, layer.eval_capacity_factor) == (1.0, 2.0)
    assert all(h for h in models.field_help(MoEConfig).values())
    assert all(h for h in models.field_help(ModelConfig).values())


def test_relative_position_buckets():
    from models.switch import relative_position_bucket
    rel = torch.tensor([0, -1, 1, -7, -8, -200, 200, 5])  # key - query
    # hand-computed (32 buckets, max distance 128): bidirectional halves them (16 + 16);
    # distances < 8 are exact, 8 starts the log range (8 + log(8/8)... = 8), far -> last (15)
    assert relative_position_bucket(rel, True, 32, 128).tolist() == [0, 1, 17, 7, 8, 15, 31, 21]
    # causal: every future key shares bucket 0; 32 buckets, exact below 16
    assert relative_position_bucket(rel, False, 32, 128).tolist() == [0, 1, 0, 7, 8, 31, 0, 0]
    # reference: the Hugging Face T5 implementation of the same bucketing
    from transformers.models.t5.modeling_t5 import T5Attention
    grid = torch.arange(-300, 300)[None, :]
    for bidirectional in (True, False):
        for nb, md in ((32, 128), (8, 20)):
            want = T5Attention._relative_position_bucket(grid, bidirectional=bidirectional,
                                                         num_buckets=nb, max_distance=md)
            assert torch.equal(relative_position_bucket(grid, bidirectional, nb, md), want)
