"""DeepSeek-V3: `model.layers[i].mlp` (DeepseekV3MoE) for layers >= first_k_dense_replace.

Routing, all in fp32 (the router casts its input and weight to fp32): sigmoid scores; the
e_score_correction_bias (aux-loss-free balancing) is added for selection only; experts in
n_group groups, the topk_group groups with the largest sum of their top-2 biased scores are
eligible; top-k inside them; gates = unbiased sigmoid scores, renormalised iff
norm_topk_prob, times routed_scaling_factor. Shared experts: n_shared_experts of size
moe_intermediate_size in one MLP, added unweighted.
"""
from .hf_moe import StackedMoEAdapter


def _routing(config, block) -> dict:
    return {"top_k": config.num_experts_per_tok, "score_func": "sigmoid",
            "norm_topk_prob": bool(config.norm_topk_prob), "n_group": config.n_group or 1,
            "topk_group": config.topk_group or 1,
            "routed_scaling_factor": float(config.routed_scaling_factor),
            "logits_dtype": "float32", "num_shared_experts": config.n_shared_experts or 0,
            "shared_d_ff": config.moe_intermediate_size}


ADAPTER = StackedMoEAdapter("deepseek_v3", ("deepseek_v3",), _routing, shared_attr="shared_experts",
                            selection_bias="gate.e_score_correction_bias")
