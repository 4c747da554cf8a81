"""What a parameter server holds: the model cut into units, units spread over servers by bytes.

A unit is a whole parameter, or one expert's row of an MoE layer's expert tensor ([E, ...]
-> E units), so a push or pull can move only the experts a worker touched. Units go to
servers greedily, largest first, each to the server with the fewest bytes so far (ties: the
lower server index): deterministic, the same on every rank.
"""
from dataclasses import dataclass

import torch.nn as nn

from ...kinds import expert_param_names


@dataclass(frozen=True)
class Unit:
    name: str          # the parameter's name in model.named_parameters()
    expert: int        # its row of an expert tensor, or -1: the whole parameter
    nbytes: int

    @property
    def key(self) -> str:
        return self.name if self.expert < 0 else f"{self.name}#{self.expert}"


def make_units(model: nn.Module, per_expert: bool = True) -> list:
    """The model's trainable parameters as units (expert tensors split per expert when
    per_expert), in named_parameters order."""
    experts = expert_param_names(model) if per_expert else set()
    units = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name in experts:
            row = p[0].numel() * p.element_size()
            units += [Unit(name, e, row) for e in range(p.shape[0])]
        else:
            units.append(Unit(name, -1, p.numel() * p.element_size()))
    return units


def assign(units: list, servers: int) -> list:
    """[[Unit] per server], balanced by bytes (see the module docstring)."""
    load, out = [0] * servers, [[] for _ in range(servers)]
    for u in sorted(units, key=lambda u: (-u.nbytes, u.key)):
        s = min(range(servers), key=lambda i: (load[i], i))
        load[s] += u.nbytes
        out[s].append(u)
    order = {u.key: i for i, u in enumerate(units)}
    return [sorted(us, key=lambda u: order[u.key]) for us in out]


def unit_view(param, unit: Unit):
    """The tensor a unit denotes inside its parameter (a view: writes go to the parameter)."""
    return param if unit.expert < 0 else param[unit.expert]
