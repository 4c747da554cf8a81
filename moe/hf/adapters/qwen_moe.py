"""Qwen2-MoE, Qwen3-MoE and OLMoE: `model.layers[i].mlp` with a `gate` router, stacked experts.

Routing: softmax in fp32, top-k, the k gates renormalised iff config.norm_topk_prob (OLMoE
and Qwen1.5/2-MoE checkpoints use the raw probabilities). Qwen2-MoE adds a shared expert
(`shared_expert`, size config.shared_expert_intermediate_size) whose output is scaled by
sigmoid(shared_expert_gate(x)). Dense layers (mlp_only_layers, decoder_sparse_step) stay.
"""
from .hf_moe import StackedMoEAdapter


def _routing(config, block) -> dict:
    return {"top_k": config.num_experts_per_tok, "norm_topk_prob": bool(config.norm_topk_prob),
            "score_dtype": "float32"}


def _qwen2_routing(config, block) -> dict:
    return {**_routing(config, block), "num_shared_experts": 1,
            "shared_d_ff": config.shared_expert_intermediate_size, "shared_expert_gate": True}


QWEN2_MOE = StackedMoEAdapter("qwen2_moe", ("qwen2_moe",), _qwen2_routing,
                              shared_attr="shared_expert", shared_gate_attr="shared_expert_gate")
QWEN3_MOE = StackedMoEAdapter("qwen3_moe", ("qwen3_moe",), _routing)
OLMOE = StackedMoEAdapter("olmoe", ("olmoe",), _routing)
