"""DeepSeek-V3 checkpoint tensors <-> moekit's GPT (models/hf_weights.py), MTP layer included.

A tiny random transformers DeepseekV3ForCausalLM (fp64, one dense layer then an MoE one,
interleaved rotary weights as DeepSeek ships them) gives the main model's tensors in the
published checkpoint's names (one tensor per expert projection); an MTP layer numbered after
the main ones (enorm, hnorm, eh_proj, a block, shared_head, and DeepSeek's copies of the
embedding and head) is added with random values. Checked:
  - moekit's GPT sized by hf.config with those weights gives transformers' logits (fp64
    weights, relative 1e-6: both compute the rotary angles in fp32 -- transformers' inv_freq
    and cos/sin, moekit's rope_cos_sin -- and DeepSeek's router logits in fp32, each in its
    own order; measured 1.2e-7, and 1.6e-3 with the rotary rows left interleaved), so the
    mapping is the model's own;
  - the MTP depth holds the MTP layer's tensors;
  - the way back gives every tensor of the checkpoint, byte for byte, and nothing else;
  - a checkpoint with more MTP layers than model.mtp_depth, or an MTP copy of the embedding
    that is not the embedding, is refused in one line naming the fix.
"""
import json

import pytest
import torch

from models.build import build_model, init_weights
from models.hf_weights import from_deepseek_v3, to_deepseek_v3
from tests.unit.hf_moe_models import build, inputs, logits, rel_diff


def _checkpoint_names(hf_model) -> dict:
    """transformers 5's in-memory tensors in the published checkpoint's names (fused expert
    banks [E, 2F, D] / [E, D, F] split into one gate/up/down tensor per expert)."""
    out = {}
    for name, t in hf_model.state_dict().items():
        t = t.detach().clone()
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{p}{e}.gate_proj.weight"], out[f"{p}{e}.up_proj.weight"] = gate.clone(), up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def _with_mtp_layer(state: dict, L: int, D: int) -> dict:
    """An MTP layer L: layer L-1's tensors re-drawn, its own norms and projection, the copies."""
    g = torch.Generator().manual_seed(7)
    out = dict(state)
    for name, t in state.items():
        if name.startswith(f"model.layers.{L - 1}."):
            out[name.replace(f".{L - 1}.", f".{L}.", 1)] = t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype)
    for own, shape in (("enorm", (D,)), ("hnorm", (D,)), ("shared_head.norm", (D,)), ("eh_proj", (D, 2 * D))):
        out[f"model.layers.{L}.{own}.weight"] = 1 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64) \
            if own != "eh_proj" else 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
    out[f"model.layers.{L}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    out[f"model.layers.{L}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    return out


def _moekit(hf_model, tmp_path, depth=1):
    from trainer.config import load_config
    hf_cfg = hf_model.config.to_dict()
    hf_cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    cfg = load_config(None, [f"hf.config={tmp_path / 'config.json'}", f"model.mtp_depth={depth}"])
    model = init_weights(build_model(cfg.model, cfg.moe, device="cpu"), seed=0).double().eval()
    return cfg, model


@pytest.fixture(scope="module")
def hf_model():
    return build("deepseek_v3")


def test_deepseek_v3_weights_give_transformers_logits_and_round_trip(hf_model, tmp_path):
    L, D = hf_model.config.num_hidden_layers, hf_model.config.hidden_size
    ckpt = _with_mtp_layer(_checkpoint_names(hf_model), L, D)
    cfg, model = _moekit(hf_model, tmp_path)
    mine = from_deepseek_v3(ckpt, cfg.model)
    missing, unexpected = model.load_state_dict(mine, strict=False)
    assert not unexpected and not [k for k in missing if k in dict(model.named_parameters())], missing
    with torch.no_grad():
        ours = model(inputs("deepseek_v3")["input_ids"])
    diff = rel_diff(ours, logits(hf_model, "deepseek_v3"))
    print(f"\nmoekit GPT with DeepSeek-V3 weights vs transformers, fp64: {diff:.2e}")
    assert diff <= 1e-6
    assert torch.equal(model.mtp[0].eh_proj.weight, ckpt[f"model.layers.{L}.eh_proj.weight"])
    assert torch.equal(model.mtp[0].block.ffn.router.selection_bias,
                       ckpt[f"model.layers.{L}.mlp.gate.e_score_correction_bias"])
    back = to_deepseek_v3(model.state_dict(), cfg.model)
    assert set(back) == set(ckpt), set(back) ^ set(ckpt)
    changed = [n for n in ckpt if not (back[n].dtype == ckpt[n].dtype and torch.equal(back[n], ckpt[n]))]
    assert not changed, changed[:5]


def test_more_mtp_layers_than_asked_or_a_different_copy_are_refused(hf_model, tmp_path):
    L, D = hf_model.config.num_hidden_layers, hf_model.config.hidden_size
    ckpt = _with_mtp_layer(_checkpoint_names(hf_model), L, D)
    cfg, _ = _moekit(hf_model, tmp_path, depth=0)
    with pytest.raises(ValueError, match=r"set model\.mtp_depth=1 to keep its weights"):
        from_deepseek_v3(ckpt, cfg.model)
    cfg, _ = _moekit(hf_model, tmp_path, depth=1)
    ckpt[f"model.layers.{L}.embed_tokens.weight"] = ckpt[f"model.layers.{L}.embed_tokens.weight"] + 1
    with pytest.raises(ValueError, match="differs from the shared tok_emb.weight"):
        from_deepseek_v3(ckpt, cfg.model)
