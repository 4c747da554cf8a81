"""moefy on transformers MoE models: converted logits equal the originals, per family.

Tolerances (relative to the largest |logit|): fp64 1e-10, fp32 1e-5. Seen: fp64 <= 4e-16,
fp32 <= 8e-7 (summation order only; see the table printed by `pytest -s`).
"""
import copy
import dataclasses
import gc
import weakref

import pytest
import torch
import transformers

from moe import MoELayer, moefy
from moe.aux import moe_layers
from tests.unit.hf_moe_models import FAMILIES, build, inputs, logits, rel_diff

transformers.logging.set_verbosity_error()
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_logits_equal_original(family, dtype):
    model = build(family, dtype=dtype)
    ref = logits(model, family)
    converted = moefy(model)
    layers = moe_layers(converted)
    assert layers
    diff = rel_diff(logits(converted, family), ref)
    print(f"\n{family} {dtype}: max |diff| / max |logit| = {diff:.2e}")
    assert diff <= RTOL[dtype]
    if family == "switch_transformers":  # expert_capacity=3 of 7 tokens really dropped some
        assert max(layer.last_stats.dropped_fraction for _, layer in layers) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_matches(family):
    model = build(family, dtype=torch.float64)
    ids = inputs(family)["input_ids"]
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    got = moefy(model).generate(ids, **kw)
    assert torch.equal(got, want)


# one routing setting changed after conversion must change the logits: the comparison above
# is sensitive to exactly the settings moefy reads from the config
def _set(**changes):
    """A router mutation: the router's frozen RoutingConfig with `changes`."""
    return lambda r: setattr(r, "config", dataclasses.replace(r.config, **changes))


MUTATIONS = {
    "mixtral": _set(norm_topk_prob=False),
    "qwen2_moe": _set(norm_topk_prob=True),
    "olmoe": _set(norm_topk_prob=True),
    "deepseek_v3": _set(routed_scaling_factor=1.0),
    "ernie4_5_moe": lambda r: r.selection_bias.zero_(),
    "switch_transformers": _set(expert_capacity=None),
}


@pytest.mark.parametrize("family", sorted(MUTATIONS))
def test_comparison_sees_each_routing_setting(family):
    model = build(family)
    ref = logits(model, family)
    converted = moefy(model)
    with torch.no_grad():
        for _, layer in moe_layers(converted):
            MUTATIONS[family](layer.router)
    assert rel_diff(logits(converted, family), ref) > 1e-6


def test_deepseek_group_limit_and_gpt_oss_swiglu_matter():
    for family, change in (("deepseek_v3", lambda m: _set(n_group=1, topk_group=1)(m.router)),
                           ("gpt_oss", lambda m: setattr(m.experts, "act", dataclasses.replace(
                               m.experts.act, limit=100.0)))):
        model = build(family)
        ref = logits(model, family)
        converted = moefy(model)
        for _, layer in moe_layers(converted):
            change(layer)
        assert rel_diff(logits(converted, family), ref) > 1e-6, family


def test_blocks_are_freed_one_by_one():
    """Each HF block is gone as soon as its MoELayer is installed (one layer's worth of
    expert weights at most exists twice)."""
    from moe.hf.adapters import mixtral
    model = build("mixtral")
    blocks = [weakref.ref(layer.mlp) for layer in model.model.layers]
    alive_at_install = []

    class Watching:
        family, model_types, kind = "mixtral", ("mixtral",), "moe"
        sites = staticmethod(mixtral.ADAPTER.sites)
        layer_kwargs = staticmethod(mixtral.ADAPTER.layer_kwargs)
        load = staticmethod(mixtral.ADAPTER.load)

        @staticmethod
        def install(site, moe):
            gc.collect()
            alive_at_install.append(sum(b() is not None for b in blocks))
            mixtral.ADAPTER.install(site, moe)

    moefy(model, adapter=Watching())
    gc.collect()
    # before installing layer i: blocks i.. are alive (the one being replaced included)
    assert alive_at_install == [2, 1] and all(b() is None for b in blocks)


def test_explicit_arguments_must_agree_with_config():
    model = build("qwen2_moe")
    with pytest.raises(ValueError, match=r"norm_topk_prob=True.*implies norm_topk_prob=False"):
        moefy(copy.deepcopy(model), norm_topk_prob=True)
    with pytest.raises(ValueError, match=r"num_experts=8.*implies num_experts=4"):
        moefy(copy.deepcopy(model), num_experts=8)
    with pytest.raises(ValueError, match="capacity_factor=1.25"):
        moefy(copy.deepcopy(model), capacity_factor=1.25)
    with pytest.raises(ValueError, match="upcycle=True"):
        moefy(copy.deepcopy(model), upcycle=True)
    with pytest.raises(ValueError, match="every=2"):
        moefy(copy.deepcopy(model), every=2)
    ok = moefy(model, num_experts=4, top_k=2, norm_topk_prob=False, aux_loss_coef=0.5)
    assert all(m.aux_loss_coef == 0.5 for _, m in moe_layers(ok))
    with pytest.raises(ValueError, match="only once"):
        moefy(ok)


def test_unsupported_family_lists_supported_ones():
    cfg = transformers.GraniteMoeConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=8,
                                        num_attention_heads=2, vocab_size=32, num_local_experts=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"Supported families: .*'mixtral'.*'switch_transformers'"):
        moefy(model)


def test_converted_layers_train():
    model = build("deepseek_v3", dtype=torch.float32).train()
    moefy(model)
    ids = inputs("deepseek_v3")["input_ids"]
    out = model(input_ids=ids, labels=ids)
    layer = moe_layers(model)[0][1]
    (out.loss + layer.aux_loss).backward()
    assert isinstance(layer, MoELayer) and layer.router.weight.grad.abs().sum() > 0
    assert layer.experts.w1.grad.abs().sum() > 0


def test_router_logit_recording_is_handed_to_moekit(tmp_path):
    """transformers' output_router_logits has no router modules left to record from: moefy
    turns it off (the aux losses come from the MoELayers) and save_hf restores it."""
    from moe.hf import save_hf
    model = build("mixtral")
    model.config.output_router_logits = True
    moefy(model)
    ids = inputs("mixtral")["input_ids"]
    assert model(input_ids=ids, labels=ids).loss > 0
    save_hf(model, tmp_path)
    assert transformers.AutoConfig.from_pretrained(tmp_path).output_router_logits is True
