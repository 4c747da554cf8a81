"""Adopting Hugging Face sparse-MoE blocks: what a MoE-family adapter is, and shared steps.

Shapes: E experts, D model dim, F expert ffn dim (moe.ExpertBank stores [in, out]).

A MoE-family adapter (`kind = "moe"`) answers, for one transformers family:
  sites(model)            -> the sparse blocks, each the `mlp` child of its Site.owner
  layer_kwargs(config, block) -> MoELayer arguments: shapes and every routing setting, read
                             from the config (and from the block where the config is silent)
  load(block, moe)        -> copy the block's weights (and selection bias) into moe
  install(site, moe)      -> put moe where the block was, keeping the caller's signature
  export(moe)             -> {name inside the block: tensor}: the block's own state dict
                             rebuilt from moe, for moe.hf.save_hf
Most families store experts stacked: gate_up_proj [E, 2F, D] (gate rows first, then up
rows) and down_proj [E, D, F], i.e. nn.Linear's [out, in] per expert.
"""
import torch
import torch.nn as nn

from .base import MoEFFN, find_sites, map_activation


def stacked_experts(module) -> bool:
    e = getattr(module, "experts", None)
    return isinstance(getattr(e, "gate_up_proj", None), torch.Tensor) and isinstance(
        getattr(e, "down_proj", None), torch.Tensor)


def stacked_sites(model):
    """`mlp` children with a linear `gate` router and stacked experts."""
    def is_block(m):
        return stacked_experts(m) and isinstance(getattr(getattr(m, "gate", None), "weight", None),
                                                 torch.Tensor)
    return find_sites(model, "mlp", is_block)


def gated_act(config, where="config.hidden_act") -> str:
    return map_activation(config.hidden_act, True, where)


@torch.no_grad()
def load_stacked(experts, bank) -> None:
    """gate_up_proj [E, 2F, D] / down_proj [E, D, F] -> w1, w3 [E, D, F] and w2 [E, F, D]."""
    F = bank.w1.shape[-1]
    gate_up = experts.gate_up_proj
    if tuple(gate_up.shape) != (bank.num_local, 2 * F, bank.w1.shape[1]):
        raise ValueError(f"experts.gate_up_proj is {tuple(gate_up.shape)}, expected "
                         f"{(bank.num_local, 2 * F, bank.w1.shape[1])} from the config")
    bank.w1.copy_(gate_up[:, :F, :].transpose(1, 2))
    bank.w3.copy_(gate_up[:, F:, :].transpose(1, 2))
    bank.w2.copy_(experts.down_proj.transpose(1, 2))


def export_stacked(bank) -> dict:
    return {"experts.gate_up_proj": torch.cat([bank.w1, bank.w3], dim=2).transpose(1, 2).contiguous(),
            "experts.down_proj": bank.w2.transpose(1, 2).contiguous()}


@torch.no_grad()
def load_gated_mlp(mlp, bank) -> None:
    """A dense gate_proj/up_proj/down_proj MLP (nn.Linear, maybe biased) -> expert 0 of bank."""
    for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        lin = getattr(mlp, theirs)
        getattr(bank, ours)[0].copy_(lin.weight.t())
        bias = getattr(bank, "b" + ours[1])
        if (bias is None) != (lin.bias is None):
            raise ValueError(f"{theirs} {'has' if lin.bias is not None else 'lacks'} a bias the "
                             f"MoE layer's shared experts {'lack' if bias is None else 'have'}")
        if bias is not None:
            bias[0].copy_(lin.bias)


def export_gated_mlp(bank, prefix: str) -> dict:
    out = {}
    for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        out[f"{prefix}.{theirs}.weight"] = getattr(bank, ours)[0].t().contiguous()
        bias = getattr(bank, "b" + ours[1])
        if bias is not None:
            out[f"{prefix}.{theirs}.bias"] = bias[0].clone()
    return out


class TupleMoEFFN(nn.Module):
    """For blocks whose callers unpack (hidden_states, router_scores), e.g. GPT-OSS's MLP."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, hidden_states: torch.Tensor):
        return self.moe(hidden_states), None


def _get(module, path: str):
    for name in path.split("."):
        module = getattr(module, name)
    return module


class StackedMoEAdapter:
    """The families with a linear `gate` router and stacked experts. Each family module makes
    one instance (no subclassing) with its `routing(config, block) -> MoELayer kwargs` and
    where its shared experts (`shared_attr`), their sigmoid gate (`shared_gate_attr`, a
    Linear D -> 1) and its selection bias (`selection_bias`, a dotted path to an [E] or
    [1, E] tensor; None: the family has none) live."""

    kind = "moe"

    def __init__(self, family: str, model_types: tuple, routing, shared_attr=None,
                 shared_gate_attr=None, selection_bias=None, selection_bias_2d=False):
        self.family, self.model_types = family, model_types
        self.routing, self.shared_attr = routing, shared_attr
        self.shared_gate_attr, self.selection_bias = shared_gate_attr, selection_bias
        self.selection_bias_2d = selection_bias_2d  # stored as [1, E] (Ernie) rather than [E]

    def sites(self, model):
        return stacked_sites(model)

    def layer_kwargs(self, config, block) -> dict:
        E, two_F, D = block.experts.gate_up_proj.shape
        return {"d_model": D, "d_ff": two_F // 2, "num_experts": E,
                "activation": gated_act(config), **self.routing(config, block)}

    @torch.no_grad()
    def load(self, block, moe) -> None:
        load_stacked(block.experts, moe.experts)
        moe.router.weight.copy_(block.gate.weight)
        if self.shared_attr is not None and moe.shared_experts is not None:
            load_gated_mlp(getattr(block, self.shared_attr), moe.shared_experts.bank)
        if self.shared_gate_attr is not None:
            moe.shared_experts.gate.copy_(getattr(block, self.shared_gate_attr).weight)
        if self.selection_bias is not None:
            moe.router.selection_bias.copy_(_get(block, self.selection_bias).reshape(-1))

    def install(self, site, moe) -> None:
        site.owner.mlp = MoEFFN(moe)

    def export(self, moe) -> dict:
        out = {"gate.weight": moe.router.weight.detach().clone(), **export_stacked(moe.experts)}
        if self.shared_attr is not None and moe.shared_experts is not None:
            out.update(export_gated_mlp(moe.shared_experts.bank, self.shared_attr))
        if self.shared_gate_attr is not None:
            out[f"{self.shared_gate_attr}.weight"] = moe.shared_experts.gate.detach().clone()
        if self.selection_bias is not None:
            bias_E = moe.router.selection_bias.detach().clone()
            out[self.selection_bias] = bias_E.unsqueeze(0) if self.selection_bias_2d else bias_E
        return out
