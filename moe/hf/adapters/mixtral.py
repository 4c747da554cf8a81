"""Mixtral: `model.layers[i].mlp` (MixtralSparseMoeBlock: `gate` router, stacked experts).

Routing: softmax in fp32 (even in an fp64 model), top-k, the k gates always renormalised
(k=1 gives gate 1.0). Mixtral's router_jitter_noise scales the whole block input in
training; moekit's `jitter` scales only the router input, so training with jitter > 0 is
close to, not equal to, Mixtral's (eval, and jitter 0, are identical).
"""
from .hf_moe import StackedMoEAdapter


def _routing(config, block) -> dict:
    return {"top_k": config.num_experts_per_tok, "norm_topk_prob": True,
            "score_dtype": "float32", "jitter": float(config.router_jitter_noise or 0.0)}


ADAPTER = StackedMoEAdapter("mixtral", ("mixtral",), _routing)
