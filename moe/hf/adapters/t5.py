"""T5: each block's last sub-layer is T5LayerFF = x + dropout(DenseReluDense(layer_norm(x))).

Replaced: only `DenseReluDense` (T5DenseActDense wi -> act -> dropout -> wo, or
T5DenseGatedActDense act(wi_0) * wi_1 -> dropout -> wo), by MoEFFN. T5LayerFF keeps its own
RMS norm, residual and dropout. The dropout between the two projections has no place inside
the experts and is left out (nothing changes in eval mode). `every` counts the encoder's and
the decoder's FFNs separately, so every=2 swaps every other FFN of each stack (Switch).
"""
from .base import (DenseWeights, FFNSpec, MoEFFN, find_sites, has_linears, linear_in_out,
                   map_activation)


def _is_t5_dense(module) -> bool:
    return has_linears(module, "wi", "wo") or has_linears(module, "wi_0", "wi_1", "wo")


def _stack(name: str) -> str:
    return "decoder" if name.startswith("decoder.") or ".decoder." in name else "encoder"


class T5Adapter:
    family = "t5"
    model_types = ("t5",)

    def sites(self, model):
        return find_sites(model, "DenseReluDense", _is_t5_dense, _stack)

    def spec(self, site, config) -> FFNSpec:
        dense = site.owner.DenseReluDense
        gated = hasattr(dense, "wi_0")
        d_ff, d_model = (dense.wi_0 if gated else dense.wi).weight.shape
        act = map_activation(config.dense_act_fn, gated, "config.dense_act_fn")
        return FFNSpec(d_model, d_ff, act, bias=False, dropout=0.0)

    def dense_weights(self, site) -> DenseWeights:
        dense = site.owner.DenseReluDense
        if hasattr(dense, "wi_0"):
            return DenseWeights(w1_DF=linear_in_out(dense.wi_0), w3_DF=linear_in_out(dense.wi_1),
                                w2_FD=linear_in_out(dense.wo))
        return DenseWeights(w1_DF=linear_in_out(dense.wi), w2_FD=linear_in_out(dense.wo))

    def install(self, site, moe, spec) -> None:
        site.owner.DenseReluDense = MoEFFN(moe, spec.dropout)


ADAPTER = T5Adapter()
