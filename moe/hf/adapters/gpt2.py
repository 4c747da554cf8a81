"""GPT-2: `transformer.h[i].mlp` (GPT2MLP: Conv1D c_fc -> act -> Conv1D c_proj -> dropout).

Replaced module: the whole `mlp`, by MoEFFN (same forward(hidden_states) -> tensor, same
output dropout). Conv1D already stores weights as [in, out], so no transpose is needed.
"""
from .base import DenseWeights, FFNSpec, MoEFFN, dropout_p, find_sites, map_activation


def _is_gpt2_mlp(module) -> bool:
    from transformers.pytorch_utils import Conv1D
    return isinstance(getattr(module, "c_fc", None), Conv1D) and isinstance(
        getattr(module, "c_proj", None), Conv1D)


class GPT2Adapter:
    family = "gpt2"
    model_types = ("gpt2",)

    def sites(self, model):
        return find_sites(model, "mlp", _is_gpt2_mlp)

    def spec(self, site, config) -> FFNSpec:
        mlp = site.owner.mlp
        d_model, d_ff = mlp.c_fc.weight.shape
        act = map_activation(config.activation_function, False, "config.activation_function")
        return FFNSpec(d_model, d_ff, act, bias=True, dropout=dropout_p(mlp.dropout))

    def dense_weights(self, site) -> DenseWeights:
        mlp = site.owner.mlp
        return DenseWeights(w1_DF=mlp.c_fc.weight.detach(), w2_FD=mlp.c_proj.weight.detach(),
                            b1_F=mlp.c_fc.bias.detach(), b2_D=mlp.c_proj.bias.detach())

    def install(self, site, moe, spec) -> None:
        site.owner.mlp = MoEFFN(moe, spec.dropout)


ADAPTER = GPT2Adapter()
