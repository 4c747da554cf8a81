"""Muon for the hidden matrices, AdamW for everything else, as one torch Optimizer.

Shapes: E experts, R rows, C columns of one matrix.

Muon (torch.optim.Muon's update, step for step): the momentum buffer B <- lerp(B, g, 1 - mu);
the update U = lerp(g, B, mu) with Nesterov, else B; U is orthogonalised by ns_steps
Newton-Schulz iterations in bf16 (coefficients a, b, c; the matrix first scaled to Frobenius
norm <= 1, transposed when it has more rows than columns); then decoupled weight decay
p <- p (1 - lr wd) and p <- p - lr' U, where lr' = lr sqrt(max(1, R / C)) ("original") or
lr 0.2 sqrt(max(R, C)) ("match_rms_adamw", Moonlight: AdamW's lr and weight decay carry over).
A 2-D parameter takes exactly torch's operations (addmm); an expert bank [E, R, C] is E
matrices, orthogonalised as one batch (baddbmm), each with its own norm and the lr' of R x C.
The iterations run in bf16 as torch's do, or in fp32 (ns_dtype; train.py's auto: bf16 on CUDA,
fp32 on a CPU, where bf16 matmuls without bf16 units ran ~50x slower than fp32: measured here).

The other groups take torch's own AdamW update (torch.optim.adam.adam with decoupled weight
decay, the function torch.optim.AdamW calls), with its state (step, exp_avg, exp_avg_sq).

Which parameters are Muon's (split_params): the weights of nn.Linear layers and the [E, R, C]
weight banks of the experts, except the output head (lm_head); AdamW's: embeddings, the head,
norms, biases (the banks' b1/b2/b3 too), routers and gates. The matrix must be whole on the
rank that computes its orthogonalisation. `MuonAdamW.orthogonaliser` says where that happens:
WholeMatrices (this file) when every matrix is whole on its rank; parallel/muon.py's
PieceOwners when a layout holds pieces of them (ZeRO slices and shards, tensor-parallel
blocks): the pieces of each matrix go to one owner rank, which orthogonalises the whole
matrix and sends each rank its piece of the result. The momentum and the update of the
weights stay elementwise on the pieces.
"""
import math

import torch
import torch.nn as nn
from torch.optim.adam import adam

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults (Keller Jordan's)
ADJUST_LR = ("match_rms_adamw", "original")


def is_hidden_matrix(module_name: str, module: nn.Module, param_name: str, p) -> bool:
    """Muon's parameters: Linear weights and expert weight banks, not the output head."""
    from moe.experts import ExpertBank
    if module_name.split(".")[-1] == "lm_head":
        return False
    if isinstance(module, nn.Linear):
        return param_name == "weight"
    return isinstance(module, ExpertBank) and p.ndim == 3


def split_params(model: nn.Module) -> tuple:
    """([Muon's parameters], [(name, AdamW's parameter)]) each listed once (tied weights)."""
    muon, seen = [], set()
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen and is_hidden_matrix(mname, module, pname, p):
                muon.append(p)
            seen.add(id(p))
    chosen = {id(p) for p in muon}
    rest = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in chosen]
    return muon, rest


NS_DTYPES = ("auto", "bf16", "fp32")


def ns_dtype(choice: str, device) -> torch.dtype:
    """The Newton-Schulz dtype: bf16 (torch.optim.Muon's) or fp32; auto = bf16 on CUDA, fp32
    elsewhere (a CPU without bf16 matrix units ran bf16 matmuls ~50x slower than fp32 here)."""
    if choice == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return torch.bfloat16 if choice == "bf16" else torch.float32


def orthogonalise(u, coefficients, steps: int, eps: float, dtype=torch.bfloat16) -> torch.Tensor:
    """Newton-Schulz zeroth power of u [R, C] or of each u[e] of [E, R, C], in `dtype`."""
    a, b, c = coefficients
    tall = u.size(-2) > u.size(-1)
    x = u.to(dtype, copy=True)
    if tall:
        x = x.mT
    if x.ndim == 2:  # torch.optim.Muon's own operations
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class WholeMatrices:
    """The orthogonaliser when every Muon parameter is a whole matrix (or bank) on its rank."""

    def __call__(self, params, updates, ns) -> list:
        return [ns(u) for u in updates]

    def shape(self, p) -> torch.Size:
        return p.shape


def adjusted_lr(lr: float, rule: str, shape) -> float:
    rows, cols = shape[-2], shape[-1]
    if rule == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


class MuonAdamW(torch.optim.Optimizer):
    """Groups with "muon": True step by Muon, the others by AdamW."""

    def __init__(self, groups, lr: float, *, betas=(0.9, 0.95), eps: float = 1e-8,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients=NS_COEFFICIENTS, ns_steps: int = 5, ns_eps: float = 1e-7,
                 adjust_lr: str = "match_rms_adamw", ns_dtype: str = "bf16"):
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"adjust_lr={adjust_lr!r}: use one of {ADJUST_LR}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype={ns_dtype!r}: use one of {NS_DTYPES}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.0, muon=False,
                        momentum=momentum, nesterov=nesterov, ns_coefficients=tuple(ns_coefficients),
                        ns_steps=ns_steps, ns_eps=ns_eps, adjust_lr=adjust_lr, ns_dtype=ns_dtype)
        super().__init__(groups, defaults)
        self.orthogonaliser = WholeMatrices()  # parallel/muon.py sets the layout's own

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon(group, params)
            else:
                self._adamw(group, params)
        return loss

    def _muon(self, group, params) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        updates = []
        for p in params:
            g = p.grad
            buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(g))
            buf.lerp_(g, 1 - mu)
            updates.append(g.lerp(buf, mu) if group["nesterov"] else buf)
        if not params:
            return
        dtype = ns_dtype(group["ns_dtype"], params[0].device)

        def ns(u):
            return orthogonalise(u, group["ns_coefficients"], group["ns_steps"], group["ns_eps"], dtype)
        for p, update in zip(params, self.orthogonaliser(params, updates, ns)):
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr"], self.orthogonaliser.shape(p)))

    def _adamw(self, group, params) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
