"""Build a moefied Hugging Face model of a family from config sections (train.py, the profiler;
config dataclass: models/hf_build.py HFConfig, read here by attribute).

Shapes: B batch, S source length, T target length, V vocabulary.
The `[hf]` config section names a family; its size comes from the `[model]` section
(d_model, n_layers, n_heads, d_ff, vocab_size, max_seq_len, dropout, tie_embeddings) unless
`hf.pretrained` points at a local save_pretrained directory to upcycle from. Nothing is
downloaded. MoE families (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, gpt_oss,
ernie4_5_moe, switch_transformers) are adopted from `hf.pretrained`: every sparse block becomes
a moekit MoELayer with the checkpoint's weights and routing (moe.moefy reads the config), so
the [moe] section does not apply to them. The returned module has the calling convention of
the toolkit's own models, so the trainer's tasks apply unchanged:
  decoder families: forward(input_ids_BS) -> logits_BSV, task "gpt"
  t5, switch_transformers: forward(input_ids_BS, decoder_input_ids_BT) -> logits_BTV, task
  "switch" (span corruption)
"""
import inspect
import os

import torch
import torch.nn as nn

from ..quiet import transformers_quietly

from .export import CONFIG_KEY
from .swap import load_moefied, moefy

DENSE_TASKS = {"gpt2": "gpt", "llama": "gpt", "mistral": "gpt", "qwen2": "gpt", "t5": "switch"}
MOE_TASKS = {"mixtral": "gpt", "qwen2_moe": "gpt", "qwen3_moe": "gpt", "olmoe": "gpt",
             "deepseek_v3": "gpt", "gpt_oss": "gpt", "ernie4_5_moe": "gpt",
             "switch_transformers": "switch"}
TASKS = {**DENSE_TASKS, **MOE_TASKS}



def pretrained_vocab_size(hf_cfg):
    """The vocabulary of hf.pretrained's config.json, or None without one."""
    if not hf_cfg.pretrained:
        return None
    import json
    with open(os.path.join(hf_cfg.pretrained, "config.json")) as f:
        return json.load(f).get("vocab_size")


def hf_config(hf_cfg, m):
    """A transformers config of family hf_cfg.family sized by ModelConfig `m`."""
    tf = transformers_quietly()
    common = dict(vocab_size=m.vocab_size, tie_word_embeddings=m.tie_embeddings,
                  pad_token_id=0, bos_token_id=0, eos_token_id=0)
    if hf_cfg.family == "gpt2":
        return tf.GPT2Config(n_embd=m.d_model, n_layer=m.n_layers, n_head=m.n_heads,
                             n_inner=m.d_ff, n_positions=m.max_seq_len, resid_pdrop=m.dropout,
                             embd_pdrop=m.dropout, attn_pdrop=m.dropout, **common)
    if hf_cfg.family == "t5":
        return tf.T5Config(d_model=m.d_model, d_ff=m.d_ff, num_layers=m.n_layers,
                           num_heads=m.n_heads, d_kv=m.d_model // m.n_heads,
                           dropout_rate=m.dropout, feed_forward_proj="relu",
                           decoder_start_token_id=0, **common)
    cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[hf_cfg.family]
    return cls(hidden_size=m.d_model, intermediate_size=m.d_ff, num_hidden_layers=m.n_layers,
               num_attention_heads=m.n_heads, num_key_value_heads=hf_cfg.kv_heads or m.n_heads,
               max_position_embeddings=m.max_seq_len, attention_dropout=m.dropout, **common)


class HFLanguageModel(nn.Module):
    """A causal LM with the toolkit's convention: forward(input_ids_BS) -> logits_BSV."""
    task = "gpt"

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids_BS: torch.Tensor, cache=None) -> torch.Tensor:
        """cache (inference, from new_cache): transformers' own KV cache, extended in place."""
        if cache is None:
            return self.hf(input_ids=input_ids_BS, use_cache=False).logits
        # transformers >= 5.2x names it `cache`, earlier releases `past_key_values`
        key = "cache" if "cache" in inspect.signature(self.hf.forward).parameters else "past_key_values"
        return self.hf(input_ids=input_ids_BS, use_cache=True, **{key: cache}).logits

    def new_cache(self):
        """An empty transformers DynamicCache for forward(..., cache=)."""
        from transformers import DynamicCache
        takes_config = "config" in inspect.signature(DynamicCache.__init__).parameters
        return DynamicCache(config=self.hf.config) if takes_config else DynamicCache()


class HFSeq2Seq(nn.Module):
    """T5 with the Switch model's convention: forward(input_ids, decoder_input_ids) -> logits."""
    task = "switch"

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids_BS, decoder_input_ids_BT, attention_mask_BS=None):
        return self.hf(input_ids=input_ids_BS, decoder_input_ids=decoder_input_ids_BT,
                       attention_mask=attention_mask_BS, use_cache=False).logits

    def encode(self, input_ids_BS, attention_mask_BS=None):
        """Encoder states [B, S, D] (decode reuses them for every target step)."""
        return self.hf.get_encoder()(input_ids=input_ids_BS,
                                     attention_mask=attention_mask_BS).last_hidden_state

    def decode_logits(self, decoder_input_ids_BT, enc_BSD, attention_mask_BS=None):
        """Logits [B, T, V] of the target ids given encode's states."""
        return self.hf(encoder_outputs=(enc_BSD,), attention_mask=attention_mask_BS,
                       decoder_input_ids=decoder_input_ids_BT, use_cache=False).logits


def _moe_args(moe_cfg, upcycle: bool) -> dict:
    if moe_cfg.first_moe_layer:
        raise ValueError(f"moe.first_moe_layer={moe_cfg.first_moe_layer} is not supported with "
                         f"hf.family; use moe.every (FFN i is MoE iff (i+1) % every == 0)")
    args = dict(num_experts=moe_cfg.num_experts, top_k=moe_cfg.top_k, every=moe_cfg.every,
                capacity_factor=moe_cfg.capacity_factor,
                eval_capacity_factor=moe_cfg.resolved_eval_capacity_factor,
                router=moe_cfg.router, aux_loss_coef=moe_cfg.aux_loss_coef,
                z_loss_coef=moe_cfg.z_loss_coef, jitter=moe_cfg.jitter,
                num_shared_experts=moe_cfg.num_shared_experts, **moe_cfg.routing_kwargs())
    if moe_cfg.d_ff:
        if upcycle:
            raise ValueError("moe.d_ff must be 0 (= the dense FFN's size) when upcycling from "
                             "hf.pretrained; set hf.upcycle=false for narrower experts")
        args["d_ff"] = moe_cfg.d_ff
    return args


def _dense_from(hf_cfg, model_cfg):
    tf = transformers_quietly()
    if hf_cfg.pretrained:
        config = tf.AutoConfig.from_pretrained(hf_cfg.pretrained, local_files_only=True)
        if getattr(config, CONFIG_KEY, None):
            return load_moefied(hf_cfg.pretrained), True   # already has its MoE layers
        auto = tf.AutoModelForSeq2SeqLM if hf_cfg.family == "t5" else tf.AutoModelForCausalLM
        return auto.from_pretrained(hf_cfg.pretrained, local_files_only=True), False
    config = hf_config(hf_cfg, model_cfg)
    auto = tf.AutoModelForSeq2SeqLM if hf_cfg.family == "t5" else tf.AutoModelForCausalLM
    return auto.from_config(config), False


def build_hf_model(hf_cfg, model_cfg, moe_cfg, seed: int = 0, device="cpu") -> nn.Module:
    """The moefied HF model in its toolkit wrapper (see the module docstring), on `device`.

    Weights are drawn from `seed` without touching the caller's RNG state. moe.every=0
    trains the dense HF model.
    """
    hf_cfg.validate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if hf_cfg.family in MOE_TASKS:
            return _adopted(hf_cfg).to(device)
        hf, has_moe = _dense_from(hf_cfg, model_cfg)
        if moe_cfg.every > 0 and not has_moe:
            upcycle = bool(hf_cfg.pretrained) and hf_cfg.upcycle
            moefy(hf, upcycle=upcycle, family=hf_cfg.family, **_moe_args(moe_cfg, upcycle))
    wrapper = (HFSeq2Seq if TASKS[hf_cfg.family] == "switch" else HFLanguageModel)(hf)
    return wrapper.to(device)


def _adopted(hf_cfg) -> nn.Module:
    """An HF MoE checkpoint with its sparse blocks converted to MoELayers (same function)."""
    tf = transformers_quietly()
    auto = tf.AutoModelForSeq2SeqLM if MOE_TASKS[hf_cfg.family] == "switch" else tf.AutoModelForCausalLM
    config = tf.AutoConfig.from_pretrained(hf_cfg.pretrained, local_files_only=True)
    if getattr(config, CONFIG_KEY, None):  # saved by moekit with its MoE layers already in
        hf = load_moefied(hf_cfg.pretrained)
    else:
        # the checkpoint's own training coefficients (0 where its family has none, e.g. the
        # aux-loss-free DeepSeek-V3); the routing itself is read by the family's adapter
        coefs = {"aux_loss_coef": getattr(config, "router_aux_loss_coef", 0.0) or 0.0,
                 "z_loss_coef": getattr(config, "router_z_loss_coef", 0.0) or 0.0}
        hf = moefy(auto.from_pretrained(hf_cfg.pretrained, local_files_only=True),
                   family=hf_cfg.family, **coefs)
    return (HFSeq2Seq if MOE_TASKS[hf_cfg.family] == "switch" else HFLanguageModel)(hf)
