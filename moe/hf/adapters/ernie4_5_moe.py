"""Ernie-4.5-MoE: `model.layers[i].mlp` (Ernie4_5_MoeSparseMoeBlock) in the MoE layer range.

Routing, all in fp32 (input and weight cast): softmax, selection on probabilities plus
gate.moe_statics.e_score_correction_bias ([1, E]), gates = the unbiased probabilities of
the chosen experts renormalised (Ernie divides by max(sum, moe_norm_min); the clamp only
matters for sums below 1e-12). Optional shared experts (moe_num_shared_experts of size
moe_intermediate_size in one MLP) added unweighted.
"""
from .hf_moe import StackedMoEAdapter


def _routing(config, block) -> dict:
    if getattr(config, "use_bias", False):
        raise ValueError("ernie4_5_moe with config.use_bias=True has biased shared experts but "
                         "unbiased routed experts, which one MoELayer cannot hold; "
                         "use_bias=False checkpoints are supported")
    return {"top_k": config.num_experts_per_tok, "norm_topk_prob": True,
            "logits_dtype": "float32", "num_shared_experts": config.moe_num_shared_experts or 0,
            "shared_d_ff": config.moe_intermediate_size}


ADAPTER = StackedMoEAdapter("ernie4_5_moe", ("ernie4_5_moe",), _routing,
                            shared_attr="shared_experts",
                            selection_bias="gate.moe_statics.e_score_correction_bias",
                            selection_bias_2d=True)
