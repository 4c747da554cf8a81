"""moefy on tiny Hugging Face models (built from configs, nothing downloaded).

Tolerances: fp32 logits of upcycled models vs the dense model: atol 2e-5 (the only
differences are summation order and tanh-GELU written two ways, seen <= 2e-6).
"""
import copy

import pytest
import torch
import transformers

from moe import MoELayer
from moe.aux import collect_aux_loss, inject_aux_loss, moe_layers
from moe.hf import load_moefied, moefy

transformers.logging.set_verbosity_error()
ATOL = 2e-5
V, D, F, S = 96, 32, 64, 8


def tiny(family: str, **over):
    small = dict(num_hidden_layers=2, hidden_size=D, intermediate_size=F, num_attention_heads=2,
                 vocab_size=V)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=2, n_inner=F, vocab_size=V,
                                      n_positions=64, bos_token_id=0, eos_token_id=0, **over)
        return transformers.GPT2LMHeadModel(cfg)
    if family in ("llama", "mistral", "qwen2"):
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}[family]
        cfg = cls(num_key_value_heads=1, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  **small, **over)
        return transformers.AutoModelForCausalLM.from_config(cfg)
    if family == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**small, **over))
    if family == "t5":
        cfg = transformers.T5Config(num_layers=2, d_model=D, d_ff=F, num_heads=2, d_kv=16,
                                    vocab_size=V, decoder_start_token_id=0, **over)
        return transformers.T5ForConditionalGeneration(cfg)
    raise KeyError(family)


def batch(family: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (2, S), generator=g)
    if family == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids.roll(1, -1), "labels": ids}
    return {"input_ids": ids, "labels": ids}


def logits(model, b) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v for k, v in b.items() if k != "labels"}).logits


FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "bert", "t5"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_upcycle_train_roundtrip(family, tmp_path):
    torch.manual_seed(0)
    dense = tiny(family).eval()
    b = batch(family)
    ref = logits(dense, b)

    one = moefy(copy.deepcopy(dense), num_experts=1, top_k=1)
    assert len(moe_layers(one)) == (4 if family == "t5" else 2)
    torch.testing.assert_close(logits(one, b), ref, atol=ATOL, rtol=0)

    four = moefy(copy.deepcopy(dense), num_experts=4, top_k=2)
    torch.testing.assert_close(logits(four, b), ref, atol=ATOL, rtol=0)
    for _, layer in moe_layers(four):   # the check means something only if routing varies
        assert (layer.last_stats.kept_E > 0).sum() >= 2

    four.train()
    opt = torch.optim.AdamW(four.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = four(**b).loss + collect_aux_loss(four)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    router_grad = moe_layers(four)[0][1].router.weight.grad
    assert router_grad is not None and router_grad.abs().sum() > 0

    four.eval()
    four.save_pretrained(tmp_path)
    again = load_moefied(str(tmp_path))
    assert type(again) is type(four) and len(moe_layers(again)) == len(moe_layers(four))
    torch.testing.assert_close(logits(again, b), logits(four, b), atol=0, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_generate_matches_dense(family):
    torch.manual_seed(1)
    dense = tiny(family).eval()
    ids = batch(family)["input_ids"][:1]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = dense.generate(ids, **kw)
    got = moefy(copy.deepcopy(dense), num_experts=4, top_k=2).generate(ids, **kw)
    assert torch.equal(got, want)


def test_top1_many_experts_is_scaled_not_equal():
    # top_k=1 gates by p_e < 1 (Switch): the upcycled output must differ; proves the test bites
    torch.manual_seed(0)
    dense = tiny("llama").eval()
    b = batch("llama")
    out = logits(moefy(copy.deepcopy(dense), num_experts=4, top_k=1), b)
    assert (out - logits(dense, b)).abs().max() > 1e-3


def test_every_counts_per_stack_and_shared_expert_stays_exact():
    torch.manual_seed(0)
    t5 = tiny("t5", num_decoder_layers=4).eval()
    b = batch("t5")
    ref = logits(t5, b)
    moefy(t5, num_experts=4, top_k=2, every=2, num_shared_experts=1)
    names = [n for n, _ in moe_layers(t5)]
    assert names == ["encoder.block.1.layer.1.DenseReluDense.moe",
                     "decoder.block.1.layer.2.DenseReluDense.moe",
                     "decoder.block.3.layer.2.DenseReluDense.moe"]
    torch.testing.assert_close(logits(t5, b), ref, atol=ATOL, rtol=0)
    assert t5.config.moekit["every"] == 2


def test_gated_gelu_and_biases_are_upcycled():
    torch.manual_seed(0)
    for model in (tiny("t5", feed_forward_proj="gated-gelu").eval(),
                  tiny("llama", mlp_bias=True, hidden_act="gelu_pytorch_tanh").eval()):
        family = "t5" if model.config.model_type == "t5" else "llama"
        b = batch(family)
        ref = logits(model, b)
        moefy(model, num_experts=3, top_k=3)
        layer = moe_layers(model)[0][1]
        assert layer.experts.activation == "geglu_tanh"
        assert (layer.experts.b3 is not None) == (family == "llama")
        torch.testing.assert_close(logits(model, b), ref, atol=ATOL, rtol=0)


def test_injected_aux_grad_equals_explicit_sum():
    torch.manual_seed(0)
    b = batch("gpt2")
    explicit = moefy(tiny("gpt2"), 4, 2, aux_loss_coef=1.0).train()
    injected = copy.deepcopy(explicit)
    inject_aux_loss(injected)
    for m in (explicit, injected):
        m.transformer.drop.p = 0.0
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
    (explicit(**b).loss + collect_aux_loss(explicit)).backward()
    injected(**b).loss.backward()
    assert collect_aux_loss(injected).item() == 0.0   # skipped: already in backward
    assert collect_aux_loss(injected, include_injected=True).item() > 0
    for (_, a), (_, c) in zip(moe_layers(explicit), moe_layers(injected)):
        torch.testing.assert_close(c.router.weight.grad, a.router.weight.grad, atol=1e-7, rtol=1e-5)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"Supported families: \['gpt2', 'llama'.*adapter="):
        moefy(torch.nn.Sequential(torch.nn.Linear(4, 4)), 4, 2)
    model = tiny("gpt2")
    with pytest.raises(ValueError, match="activation"):
        moefy(model, 4, 2, activation="relu")
    with pytest.raises(ValueError, match="every"):
        moefy(model, 4, 2, every=0)
    with pytest.raises(ValueError, match="top_k"):
        moefy(model, 2, 3)
    with pytest.raises(ValueError, match="ep_group"):
        moefy(model, 4, 2, ep_group=None)
    moefy(model, 4, 2)
    with pytest.raises(ValueError, match="only once"):
        moefy(model, 4, 2)
    assert all(isinstance(m, MoELayer) for _, m in moe_layers(model))
    with pytest.raises(ValueError, match="hidden_act"):
        moefy(tiny("llama", hidden_act="relu"), 4, 2)


def test_build_hf_model_from_config_and_pretrained(tmp_path):
    from models.config import ModelConfig, MoEConfig
    from models.hf_build import HFConfig, build_hf_model
    m = ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=2, d_ff=F, max_seq_len=32)
    moe_cfg = MoEConfig(num_experts=4, top_k=2, every=1, capacity_factor=None)
    t5 = build_hf_model(HFConfig(family="t5"), m, moe_cfg, seed=3)
    b = batch("t5")
    assert t5.task == "switch" and len(moe_layers(t5)) == 4
    assert t5(b["input_ids"], b["decoder_input_ids"]).shape == (2, S, V)
    again = build_hf_model(HFConfig(family="t5"), m, moe_cfg, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(t5.state_dict().values(), again.state_dict().values()))

    dense = tiny("llama").eval()
    dense.save_pretrained(tmp_path)
    lm = build_hf_model(HFConfig(family="llama", pretrained=str(tmp_path)), m, moe_cfg).eval()
    ids = batch("llama")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(lm(ids), dense(input_ids=ids).logits, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="masked-LM"):
        build_hf_model(HFConfig(family="bert"), m, moe_cfg)
