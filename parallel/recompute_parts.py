"""parallel.recompute=selective's parts (Megatron's names): the one list of them, what each
recomputes and what it frees, and what the model must have for it.

Read by parallel/recompute.py (one function applying each part), parallel/planner/memory.py
(one function pricing what each frees), parallel/plan_rules (the accepted names, and the
refusal of a part the model lacks); tests/unit/test_recompute_parts.py fails where a part
is missing from one of them. No torch here: the plan's rules import it.
"""
from dataclasses import dataclass

__all__ = ["RecomputePart", "RECOMPUTE_PARTS"]


@dataclass(frozen=True)
class RecomputePart:
    recomputes: str   # what runs again in backward (the module method checkpointed)
    frees: str        # what the forward then no longer holds for backward
    needs: str        # what the model must have for it ("" every block has it)


RECOMPUTE_PARTS = {
    "core_attn": RecomputePart(
        "the attention core softmax(q k^T) v (Attention.core)",
        "what the kernel saves beyond q, k, v (the fused kernels' log-sum-exp)", ""),
    "layernorm": RecomputePart(
        "the block's two norms, from their inputs, when backward needs their outputs "
        "(parallel/output_recompute.py)",
        "the norms' outputs the layers reading them would keep (under autocast only the fp32 "
        "readers' copies, the router's: the others keep their own low-precision casts)", ""),
    "moe_act": RecomputePart(
        "the experts' activation (routed and shared)",
        "the activation outputs; the pre-activations stay", "MoE blocks"),
    "mlp": RecomputePart(
        "the dense FFN of a block without MoE",
        "everything it saves but its input", "a block without MoE"),
    "mla_up_proj": RecomputePart(
        "MLA's up-projections (LatentAttention.up)",
        "the normalised latents and the projections; the latents stay", "model.attention='mla'"),
    "shared_experts": RecomputePart(
        "the shared experts of MoE blocks",
        "everything they save but their input", "moe.num_shared_experts > 0"),
    "experts": RecomputePart(
        "the routed experts (ExpertBank)",
        "the experts' hidden activations; the dispatched rows stay", "MoE blocks"),
}
