"""Shared transformer pieces for the GPT and Switch models.

Shapes: B batch, S query length, L key length, D model dim, H heads (local: -1 in views so a
tensor-parallel split of the projections just works), Hd head dim, V vocab.

Every module that owns parameters has `reset_parameters()`; models.init.init_weights calls
them. Linear/Embedding are thin nn.Linear/nn.Embedding subclasses (so tensor-parallel styles
still recognise them) whose reset uses the configured normal std instead of torch's default.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe import DenseFFN, MoELayer


class Linear(nn.Linear):
    """nn.Linear with weight ~ N(0, init_std) and zero bias."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False, init_std: float = 0.02):
        self.init_std = init_std  # set before super().__init__, which calls reset_parameters
        super().__init__(d_in, d_out, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding with weight ~ N(0, init_std) (torch's default std 1 is far too large)."""

    def __init__(self, num: int, dim: int, init_std: float = 0.02):
        self.init_std = init_std
        super().__init__(num, dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)


def make_norm(kind: str, dim: int, eps: float, bias: bool = False) -> nn.Module:
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    raise ValueError(f"model.norm={kind!r} is not supported; use 'rmsnorm' or 'layernorm'")


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device) -> tuple:
    """cos/sin tables [S, Hd/2], computed per call: no buffer to materialise after meta init."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles_SH = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles_SH.cos(), angles_SH.sin()


def apply_rope(x_BHSD: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + Hd/2) by position-dependent angles (GPT-NeoX layout)."""
    x1, x2 = x_BHSD.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos_SH - x2 * sin_SH, x2 * cos_SH + x1 * sin_SH), dim=-1)
    return out.to(x_BHSD.dtype)


class Attention(nn.Module):
    """Multi-head attention with separate q/k/v/o projections (column/row-parallel friendly).

    Self-attention when `kv` is None, else cross-attention over `kv`. `bias_1HSL` is an
    additive float bias (T5 relative positions, masks), `causal` a lower-triangular mask.
    """

    def __init__(self, d_model: int, n_heads: int, *, bias: bool = False, dropout: float = 0.0,
                 init_std: float = 0.02, out_init_std: float = 0.02, rope_theta=None):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.rope_theta = rope_theta  # None: no rotary positions
        self.wq = Linear(d_model, d_model, bias, init_std)
        self.wk = Linear(d_model, d_model, bias, init_std)
        self.wv = Linear(d_model, d_model, bias, init_std)
        self.wo = Linear(d_model, d_model, bias, out_init_std)

    def _heads(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        return x_BSD.view(B, S, -1, self.head_dim).transpose(1, 2)

    def forward(self, x_BSD, kv_BLD=None, bias_1HSL=None, causal: bool = False):
        kv_BLD = x_BSD if kv_BLD is None else kv_BLD
        q, k, v = self._heads(self.wq(x_BSD)), self._heads(self.wk(kv_BLD)), self._heads(self.wv(kv_BLD))
        if self.rope_theta is not None:
            cos, sin = rope_cos_sin(q.shape[2], self.head_dim, self.rope_theta, q.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None
        if bias_1HSL is not None:
            mask = bias_1HSL.to(q.dtype)
            if causal:
                S, L = q.shape[2], k.shape[2]
                future_SL = torch.ones(S, L, dtype=torch.bool, device=q.device).triu(1)
                mask = mask.masked_fill(future_SL, float("-inf"))
        p = self.dropout if self.training else 0.0
        o_BHSD = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                is_causal=causal and mask is None)
        B, _, S, _ = o_BHSD.shape
        return self.wo(o_BHSD.transpose(1, 2).reshape(B, S, -1))


def make_ffn(model_cfg, moe_cfg, block_idx: int, out_init_std: float, bias: bool) -> nn.Module:
    """moe.MoELayer for blocks chosen by moe.every/first_moe_layer, else moe.DenseFFN."""
    m = model_cfg
    if moe_cfg is not None and moe_cfg.is_moe_block(block_idx):
        return MoELayer(
            m.d_model, moe_cfg.d_ff or m.d_ff, moe_cfg.num_experts, moe_cfg.top_k,
            moe_cfg.capacity_factor, m.activation, router=moe_cfg.router,
            eval_capacity_factor=moe_cfg.resolved_eval_capacity_factor,
            aux_loss_coef=moe_cfg.aux_loss_coef, z_loss_coef=moe_cfg.z_loss_coef,
            jitter=moe_cfg.jitter, num_shared_experts=moe_cfg.num_shared_experts,
            expert_bias=bias, init_std=m.init_std, out_init_std=out_init_std,
            **moe_cfg.routing_kwargs())
    glu = {} if moe_cfg is None else dict(swiglu_alpha=moe_cfg.swiglu_alpha,
                                          swiglu_limit=moe_cfg.swiglu_limit)
    ffn = DenseFFN(m.d_model, m.d_ff, m.activation, bias, m.init_std, **glu)
    # DenseFFN has no out_init_std argument; its bank reads this attribute in reset_parameters
    ffn.bank.out_init_std = out_init_std
    return ffn


def out_init_std(model_cfg) -> float:
    """GPT-2 style: residual-output projections shrink with depth, 1/sqrt(2 * n_layers)."""
    return model_cfg.init_std / math.sqrt(2 * model_cfg.n_layers)
