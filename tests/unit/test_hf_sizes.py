"""hf.config: a transformers config.json rebuilt as moekit's own GPT.

Proof against transformers itself:
- the same function: tiny random models of each MoE family (and llama/qwen3 dense) built by
  transformers, their weights copied into the GPT that hf.config builds; logits equal in
  float64 to 1e-6 of the largest logit (transformers' RMSNorm rounds through float32);
- the same size: the four shipped config.json files build, on the meta device, exactly as
  many parameters as transformers' own model of that config; and the totals the model cards
  publish (Mixtral-8x7B 46.7B, Qwen3-30B-A3B 30.5B, Qwen3-235B-A22B 235B, DeepSeek-V3 671B).
"""
import pytest
import torch
import transformers

from models.config import ModelConfig, MoEConfig
from models.gpt import GPT
from models.hf_sizes import gpt_sections, read_hf_config
from moe import moefy
from trainer.config import ConfigError, load_config

from .hf_moe_models import config as tiny_config, rel_diff

SHIPPED = {"mixtral_8x7b": 46.70e9, "qwen3_30b_a3b": 30.53e9, "qwen3_235b_a22b": 235.09e9,
           "deepseek_v3": 671.03e9}

_ATTN_NAMES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "q_norm": "q_norm",
               "k_norm": "k_norm", "q_a_proj": "wq_a", "q_a_layernorm": "q_a_norm", "q_b_proj": "wq_b",
               "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b"}


def _gpt_for(hf_config) -> GPT:
    sections = gpt_sections(hf_config.to_dict())
    m, mc = ModelConfig(**sections["model"]).validate(), MoEConfig(**sections["moe"])
    mc.validate(m)
    return GPT(m, mc).double().eval()


@torch.no_grad()
def _copy(hf, gpt) -> None:
    """transformers' weights (sparse blocks already moefied) into the GPT, by name."""
    src = hf.model
    gpt.tok_emb.weight.copy_(src.embed_tokens.weight)
    gpt.lm_head.weight.copy_(hf.lm_head.weight)
    gpt.norm.weight.copy_(src.norm.weight)
    for layer, block in zip(src.layers, gpt.blocks):
        block.attn_norm.weight.copy_(layer.input_layernorm.weight)
        block.ffn_norm.weight.copy_(layer.post_attention_layernorm.weight)
        for name, mod in layer.self_attn.named_children():
            if name in _ATTN_NAMES:
                getattr(block.attn, _ATTN_NAMES[name]).load_state_dict(mod.state_dict())
        mlp = layer.mlp
        if hasattr(mlp, "gate_proj"):  # a dense SwiGLU MLP: bank [1, in, out]
            bank = block.ffn.bank
            bank.w1.copy_(mlp.gate_proj.weight.t()[None])
            bank.w3.copy_(mlp.up_proj.weight.t()[None])
            bank.w2.copy_(mlp.down_proj.weight.t()[None])
        else:  # moefy's wrapper around the MoELayer it converted the sparse block into
            block.ffn.load_state_dict(mlp.moe.state_dict())


def _tiny(family: str):
    if family in ("llama", "qwen3"):
        cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
        return cls(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=48, vocab_size=96, max_position_embeddings=64,
                   tie_word_embeddings=False, head_dim=16 if family == "qwen3" else None)
    cfg = tiny_config(family)
    if family == "deepseek_v3":
        cfg.rope_interleave = False  # moekit's rotary turns channel pairs (i, i + R/2)
    return cfg


def _random_hf(cfg, seed=0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager") \
        if hasattr(cfg, "num_experts_per_tok") else transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)   # decisive routing
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return hf.double().eval()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3"])
def test_same_function_as_transformers(family):
    cfg = _tiny(family)
    hf = _random_hf(cfg)
    ids = torch.randint(2, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=ids, use_cache=False).logits
    if hasattr(cfg, "num_experts_per_tok"):
        moefy(hf, family=family)
    gpt = _gpt_for(cfg)
    _copy(hf, gpt)
    with torch.no_grad():
        got = gpt(ids)
    assert rel_diff(got, want) < 1e-6, rel_diff(got, want)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_sizes_equal_transformers(name):
    path = f"configs/models/hf/{name}.json"
    cfg = load_config(None, [f"hf.config={path}"])
    cfg.model.validate()
    cfg.moe.validate(cfg.model)
    with torch.device("meta"):
        ours = sum(p.numel() for p in GPT(cfg.model, cfg.moe).parameters())
        hf_cfg = transformers.AutoConfig.for_model(**read_hf_config(path))
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_cfg).parameters())
    assert ours == theirs
    assert abs(ours - SHIPPED[name]) / SHIPPED[name] < 1e-3  # the model card's total


def test_what_the_user_sets_wins(tmp_path):
    """The config.json's sizes first, then the TOML, then the command line; a relative
    hf.config is found beside the TOML."""
    (tmp_path / "mixtral.json").write_text(open("configs/models/hf/mixtral_8x7b.json").read())
    toml = tmp_path / "small.toml"
    toml.write_text('[hf]\nconfig = "mixtral.json"\n[model]\nd_model = 64\nn_layers = 2\n')
    cfg = load_config(toml, ["moe.num_experts=4"])
    m = cfg.model
    assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff) == (64, 2, 32, 8, 14336)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.aux_loss_coef) == (4, 2, 0.02)
    assert cfg.hf.config == str(tmp_path / "mixtral.json")


def test_refusals(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "gpt2", "n_embd": 8}')
    with pytest.raises(ConfigError, match=r"hf.config=.*model_type='gpt2'.*use a config.json of"):
        load_config(None, [f"hf.config={tmp_path}"])
    with pytest.raises(ConfigError, match=r"hf.config='nowhere.json' is not a config.json"):
        load_config(None, ["hf.config=nowhere.json"])
