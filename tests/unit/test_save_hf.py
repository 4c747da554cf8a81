"""save_hf: moefied models written as checkpoints that plain transformers from_pretrained loads
into the MoE architecture, with the same logits (fp64: relative 1e-10).
"""
import pytest
import torch
import transformers

from moe.aux import moe_layers
from moe.hf import moefy, save_hf
from tests.unit.hf_moe_models import FAMILIES, build, inputs, logits, rel_diff
from tests.unit.test_swap import tiny

transformers.logging.set_verbosity_error()


def load(path, family="x"):
    cls = (transformers.SwitchTransformersForConditionalGeneration
           if family == "switch_transformers" else transformers.AutoModelForCausalLM)
    kw = {} if family == "switch_transformers" else {"experts_implementation": "eager"}
    return cls.from_pretrained(path, dtype=torch.float64, **kw).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_round_trips_through_transformers(family, tmp_path):
    model = build(family)
    ref = logits(model, family)
    arch = type(model)
    moefy(model)
    with torch.no_grad():  # change the weights after conversion: the saved ones must be ours
        for _, layer in moe_layers(model):
            layer.experts.w2.mul_(1.5)
    ours = logits(model, family)
    assert rel_diff(ours, ref) > 1e-3
    save_hf(model, tmp_path)
    back = load(tmp_path, family)
    assert type(back) is arch and not moe_layers(back)
    diff = rel_diff(logits(back, family), ours)
    print(f"\nsave_hf {family} fp64 round trip: {diff:.2e}")
    assert diff <= 1e-10


def diversify(model, seed=0):
    """Upcycled experts are identical copies; make them (and the router) differ so the export
    of every expert and of the router is checked, not only their common value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in moe_layers(model):
            for p in (layer.experts.w1, layer.experts.w2, layer.experts.w3, layer.router.weight):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
            if layer.shared_experts is not None:
                for p in layer.shared_experts.parameters():
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return model


@pytest.mark.parametrize("family,target,kw", [
    ("llama", transformers.MixtralForCausalLM, {}),
    ("mistral", transformers.MixtralForCausalLM, {}),
    ("llama", transformers.MixtralForCausalLM, dict(top_k=1, norm_topk_prob=True)),
    ("qwen2", transformers.Qwen2MoeForCausalLM, {}),
    ("qwen2", transformers.Qwen2MoeForCausalLM, dict(every=2, norm_topk_prob=False)),
    ("qwen2", transformers.Qwen2MoeForCausalLM, dict(num_shared_experts=1, shared_d_ff=16,
                                                     shared_expert_gate=True)),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_upcycled_dense_model_exports_as_moe_architecture(family, target, kw, dtype, tmp_path):
    """fp64: moefied with score_dtype='float32' (the targets compute router scores in fp32
    whatever the model dtype), relative 1e-10; fp32 with the defaults: 1e-5."""
    torch.manual_seed(0)
    kw = {"top_k": 2, **kw}
    if dtype == torch.float64:
        kw["score_dtype"] = "float32"
    model = diversify(moefy(tiny(family).to(dtype).eval(), 4, kw.pop("top_k"), **kw))
    ids = torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    save_hf(model, tmp_path)
    back = load(tmp_path).to(dtype)
    assert type(back) is target
    with torch.no_grad():
        theirs = back(input_ids=ids).logits
    diff = rel_diff(theirs, ours)
    print(f"\nupcycled {family} {kw} -> {target.__name__} {dtype}: {diff:.2e}")
    assert diff <= (1e-10 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("family,kw,msg", [
    ("gpt2", {}, r"no transformers MoE architecture.*load_moefied"),
    ("llama", dict(top_k=1), r"as mixtral.*gates not renormalised.*load_moefied"),
    ("llama", dict(capacity_factor=1.0), r"capacity limit"),
    ("llama", dict(every=2), r"every=2.*load_moefied"),
    ("llama", dict(num_shared_experts=1), r"shared experts"),
    ("qwen2", dict(num_shared_experts=1), r"without shared_expert_gate"),
    ("mistral", dict(score_func="sigmoid"), r"score_func='sigmoid'"),
])
def test_upcycled_model_without_matching_architecture_is_refused(family, kw, msg, tmp_path):
    kw = {"top_k": 2, **kw}
    model = moefy(tiny(family), 4, kw.pop("top_k"), **kw)
    with pytest.raises(ValueError, match=msg):
        save_hf(model, tmp_path)


def test_plain_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="save_pretrained"):
        save_hf(tiny("llama"), tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_save_pretrained_and_load_moefied(family, tmp_path):
    """The moekit route keeps the MoELayers (e.g. to resume training), whatever renames
    transformers' save_pretrained applies (Mixtral writes `mlp` as `block_sparse_moe`)."""
    from moe.hf import load_moefied
    model = moefy(build(family))
    with torch.no_grad():
        for _, layer in moe_layers(model):
            layer.experts.w1.mul_(0.5)
    ours = logits(model, family)
    model.save_pretrained(tmp_path)
    back = load_moefied(str(tmp_path))
    assert len(moe_layers(back)) == len(moe_layers(model))
    assert rel_diff(logits(back, family), ours) <= 1e-12


def test_moved_selection_bias_without_a_slot_is_refused(tmp_path):
    """Mixtral checkpoints have no selection bias: after update_selection_bias moved it,
    save_hf refuses rather than silently dropping it; DeepSeek-V3 writes it back."""
    model = moefy(build("mixtral"))
    with torch.no_grad():
        moe_layers(model)[0][1].router.selection_bias[0] = 0.5
    with pytest.raises(ValueError, match="selection bias moved.*load_moefied"):
        save_hf(model, tmp_path / "mixtral")
    ds = moefy(build("deepseek_v3"))
    before = logits(ds, "deepseek_v3")
    with torch.no_grad():
        moe_layers(ds)[0][1].router.selection_bias.copy_(torch.linspace(-0.6, 0.6, 8))
    want = logits(ds, "deepseek_v3")
    assert rel_diff(want, before) > 1e-6  # the new bias changes which experts are chosen
    save_hf(ds, tmp_path / "ds")
    assert rel_diff(logits(load(tmp_path / "ds"), "deepseek_v3"), want) <= 1e-10
