"""A bank of expert FFNs run as grouped matmuls over contiguous per-expert row slices.

Shapes: N dispatched rows (sorted by expert), D model dim, F ffn dim, E local experts.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

# name -> (activation, gated). Gated variants compute act(x @ w1) * (x @ w3).
ACTIVATIONS = {
    "gelu": (F.gelu, False),
    "gelu_tanh": (lambda h: F.gelu(h, approximate="tanh"), False),
    "relu": (F.relu, False),
    "silu": (F.silu, False),
    "swiglu": (F.silu, True),
    "geglu": (F.gelu, True),
    "geglu_tanh": (lambda h: F.gelu(h, approximate="tanh"), True),  # T5 v1.1, Gemma
}


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use one of {sorted(ACTIVATIONS)}")


class ExpertBank(nn.Module):
    """`num_local` experts with weights w1 [E, D, F], w2 [E, F, D] (and w3 [E, D, F] if gated).

    `forward(x_ND, counts)` runs expert e on rows [sum(counts[:e]), sum(counts[:e+1])); an
    expert with no rows costs nothing. Optional biases b1 [E, F], b2 [E, D], b3 [E, F] exist so
    dense FFNs with biases (GPT-2, BERT) can be upcycled exactly.
    """

    def __init__(self, num_local: int, d_model: int, d_ff: int, activation: str = "gelu",
                 bias: bool = False, init_std: float = 0.02, out_init_std=None):
        super().__init__()
        check_activation(activation)
        self.activation = activation
        self.act_fn, self.gated = ACTIVATIONS[activation]
        self.init_std = init_std
        self.out_init_std = init_std if out_init_std is None else out_init_std
        self.w1 = nn.Parameter(torch.empty(num_local, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_local, d_ff, d_model))
        self.w3 = nn.Parameter(torch.empty(num_local, d_model, d_ff)) if self.gated else None
        self.b1 = nn.Parameter(torch.empty(num_local, d_ff)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_local, d_model)) if bias else None
        self.b3 = nn.Parameter(torch.empty(num_local, d_ff)) if bias and self.gated else None
        self.reset_parameters()

    @property
    def num_local(self) -> int:
        return self.w1.shape[0]

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=self.init_std)
        nn.init.normal_(self.w2, std=self.out_init_std)
        for p in (self.w3,):
            if p is not None:
                nn.init.normal_(p, std=self.init_std)
        for p in (self.b1, self.b2, self.b3):
            if p is not None:
                nn.init.zeros_(p)

    def _per_expert(self, p):
        # unbind once: its backward stacks all expert grads in one allocation, where indexing
        # w[e] per expert would allocate a full-size zero gradient per expert.
        return None if p is None else p.unbind(0)

    def forward(self, x_ND: torch.Tensor, counts: list) -> torch.Tensor:
        if len(counts) != self.num_local:
            raise ValueError(f"counts has {len(counts)} entries for {self.num_local} local experts")
        if x_ND.shape[0] == 0:  # nothing routed here: an empty result still tied to the weights
            return x_ND @ self.w1[0, :, :0] @ self.w2[0, :0, :]
        w1, w2, w3, b1, b2, b3 = (self._per_expert(p) for p in
                                  (self.w1, self.w2, self.w3, self.b1, self.b2, self.b3))
        outs = []
        for e, x_nD in enumerate(torch.split(x_ND, counts)):
            if counts[e] == 0:
                continue
            h_nF = x_nD @ w1[e] if b1 is None else torch.addmm(b1[e], x_nD, w1[e])
            h_nF = self.act_fn(h_nF)
            if self.gated:
                h_nF = h_nF * (x_nD @ w3[e] if b3 is None else torch.addmm(b3[e], x_nD, w3[e]))
            outs.append(h_nF @ w2[e] if b2 is None else torch.addmm(b2[e], h_nF, w2[e]))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class DenseFFN(nn.Module):
    """A plain FFN with the same activations (used for dense blocks and shared experts)."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = False,
                 init_std: float = 0.02):
        super().__init__()
        self.bank = ExpertBank(1, d_model, d_ff, activation, bias, init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = x.reshape(-1, x.shape[-1])
        return self.bank(x_TD, [x_TD.shape[0]]).reshape(x.shape)
