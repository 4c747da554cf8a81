"""Tiny random transformers MoE models, one per family, built from configs (no downloads).

V vocab, D model dim. Routers are re-drawn with a large std and selection biases set to
non-zero values, so routing is decisive (no near-ties) and every option is exercised.
"""
import torch
import transformers

V, D = 96, 32
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss",
            "ernie4_5_moe", "switch_transformers"]
_ATTN = dict(num_hidden_layers=2, hidden_size=D, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=V, bos_token_id=0, eos_token_id=1, pad_token_id=0,
             max_position_embeddings=64, tie_word_embeddings=False)


def config(family: str):
    t = transformers
    if family == "mixtral":
        return t.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **_ATTN)
    if family == "qwen2_moe":
        return t.Qwen2MoeConfig(intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, shared_expert_intermediate_size=20,
                                norm_topk_prob=False, mlp_only_layers=[1], **_ATTN)
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, **_ATTN)
    if family == "olmoe":
        return t.OlmoeConfig(intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                             norm_topk_prob=False, **_ATTN)
    if family == "deepseek_v3":
        return t.DeepseekV3Config(intermediate_size=40, moe_intermediate_size=24, n_routed_experts=8,
                                  num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                                  first_k_dense_replace=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, q_lora_rank=16, kv_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **_ATTN)
    if family == "gpt_oss":
        return t.GptOssConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                              head_dim=16, sliding_window=4, swiglu_limit=1.5, **_ATTN)
    if family == "ernie4_5_moe":
        return t.Ernie4_5_MoeConfig(intermediate_size=40, moe_intermediate_size=24, moe_num_experts=4,
                                    moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=0,
                                    moe_layer_end_index=1, moe_layer_interval=1, **_ATTN)
    if family == "switch_transformers":
        return t.SwitchTransformersConfig(vocab_size=V, d_model=D, d_ff=24, d_kv=16, num_heads=2,
                                          num_layers=2, num_decoder_layers=2, num_experts=4,
                                          expert_capacity=3, encoder_sparse_step=1,
                                          decoder_sparse_step=1, decoder_start_token_id=0,
                                          pad_token_id=0, eos_token_id=1)
    raise KeyError(family)


def build(family: str, seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    cfg = config(family)
    if family == "switch_transformers":
        model = transformers.SwitchTransformersForConditionalGeneration(cfg)
    else:  # the eager expert loop: the default grouped_mm kernel has no float64
        model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[0]
            if leaf.endswith(("mlp.gate", "mlp.router", "router.classifier")) and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            if "experts" in name:  # O(1) expert outputs, so the MoE part matters in the logits
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.to(dtype).eval()


def inputs(family: str, seed: int = 0, S: int = 7) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (2, S), generator=g)
    if family == "switch_transformers":
        return {"input_ids": ids, "decoder_input_ids": ids.roll(1, -1)}
    return {"input_ids": ids}


def logits(model, family: str, seed: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs(family, seed)).logits


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())
