"""Llama-style gated MLP: `layers[i].mlp` = down_proj(act(gate_proj(x)) * up_proj(x)).

Shared by the llama, mistral and qwen2 adapters (each is one line in its own module).
Replaced module: the whole `mlp`, by MoEFFN (forward(x) -> tensor, no dropout). Weights:
gate_proj -> w1, up_proj -> w3, down_proj -> w2, each nn.Linear [out, in] transposed.
"""
from .base import (DenseWeights, FFNSpec, MoEFFN, find_sites, has_linears, linear_bias,
                   linear_in_out, map_activation)


def _is_gated_mlp(module) -> bool:
    return has_linears(module, "gate_proj", "up_proj", "down_proj")


class GatedMLPAdapter:
    def __init__(self, family: str, model_types: tuple):
        self.family, self.model_types = family, model_types

    def sites(self, model):
        return find_sites(model, "mlp", _is_gated_mlp)

    def spec(self, site, config) -> FFNSpec:
        mlp = site.owner.mlp
        d_ff, d_model = mlp.gate_proj.weight.shape
        act = map_activation(config.hidden_act, True, "config.hidden_act")
        return FFNSpec(d_model, d_ff, act, bias=mlp.gate_proj.bias is not None, dropout=0.0)

    def dense_weights(self, site) -> DenseWeights:
        mlp = site.owner.mlp
        return DenseWeights(
            w1_DF=linear_in_out(mlp.gate_proj), w2_FD=linear_in_out(mlp.down_proj),
            w3_DF=linear_in_out(mlp.up_proj), b1_F=linear_bias(mlp.gate_proj),
            b2_D=linear_bias(mlp.down_proj), b3_F=linear_bias(mlp.up_proj))

    def install(self, site, moe, spec) -> None:
        site.owner.mlp = MoEFFN(moe, spec.dropout)
