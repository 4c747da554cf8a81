"""BERT: each BertLayer's FFN is split over two modules,
`intermediate` (dense D->F + act) and `output` (dense F->D, dropout, LayerNorm(h + residual)).

Replaced: `intermediate` becomes nn.Identity (so feed_forward_chunk hands the attention
output straight on) and `output` becomes MoEBertOutput, which keeps BertOutput's signature
forward(hidden_states, input_tensor) and its own dropout and LayerNorm (the same module, so
its state-dict keys `output.LayerNorm.*` do not change).
"""
import torch.nn as nn

from .base import (DenseWeights, FFNSpec, find_sites, has_linears, linear_bias,
                   linear_in_out, map_activation)


class MoEBertOutput(nn.Module):
    def __init__(self, moe: nn.Module, layer_norm: nn.Module, dropout: nn.Module):
        super().__init__()
        self.moe, self.LayerNorm, self.dropout = moe, layer_norm, dropout

    def forward(self, hidden_states, input_tensor):
        # hidden_states is the attention output here (intermediate is an Identity)
        return self.LayerNorm(self.dropout(self.moe(hidden_states)) + input_tensor)


def _is_bert_ffn_owner(intermediate) -> bool:
    return has_linears(intermediate, "dense") and hasattr(intermediate, "intermediate_act_fn")


class BertAdapter:
    family = "bert"
    model_types = ("bert",)

    def sites(self, model):
        sites = find_sites(model, "intermediate", _is_bert_ffn_owner)
        return [s for s in sites if has_linears(s.owner.output, "dense")
                and hasattr(s.owner.output, "LayerNorm")]

    def spec(self, site, config) -> FFNSpec:
        inter = site.owner.intermediate
        d_ff, d_model = inter.dense.weight.shape
        act = map_activation(config.hidden_act, False, "config.hidden_act")
        # dropout=0: BertOutput's own dropout module moves into MoEBertOutput unchanged
        return FFNSpec(d_model, d_ff, act, bias=inter.dense.bias is not None, dropout=0.0)

    def dense_weights(self, site) -> DenseWeights:
        inter, out = site.owner.intermediate, site.owner.output
        return DenseWeights(w1_DF=linear_in_out(inter.dense), w2_FD=linear_in_out(out.dense),
                            b1_F=linear_bias(inter.dense), b2_D=linear_bias(out.dense))

    def install(self, site, moe, spec) -> None:
        out = site.owner.output
        site.owner.output = MoEBertOutput(moe, out.LayerNorm, out.dropout)
        site.owner.intermediate = nn.Identity()


ADAPTER = BertAdapter()
