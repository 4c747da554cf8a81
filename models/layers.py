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

from moe.cast_once import readers
from moe.dtypes import accumulation_dtype


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


def rms_norm(x: torch.Tensor, shape, weight, eps) -> torch.Tensor:
    """F.rms_norm with the weight in x's dtype. Under autocast x arrives in bf16 while the
    weight stays an fp32 parameter; mixed dtypes cannot take torch's fused kernel and fall
    back to a composite of about eight kernels (with a warning). The weight's one cast per
    call is D elements; its gradient still flows to the fp32 parameter."""
    if weight is not None and weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return F.rms_norm(x, shape, weight, eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm that runs torch's fused kernel under autocast too (rms_norm above)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


def make_norm(kind: str, dim: int, eps: float, bias: bool = False) -> nn.Module:
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
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
    x1, x2 = x_BHSD.to(accumulation_dtype(x_BHSD.dtype)).chunk(2, dim=-1)
    out = torch.cat((x1 * cos_SH - x2 * sin_SH, x2 * cos_SH + x1 * sin_SH), dim=-1)
    return out.to(x_BHSD.dtype)


class Attention(nn.Module):
    """Multi-head attention with separate q/k/v/o projections (column/row-parallel friendly).

    Self-attention when `kv` is None, else cross-attention over `kv`. `bias_1HSL` is an
    additive float bias (T5 relative positions, masks), `causal` a lower-triangular mask.
    Grouped-query attention with n_kv_heads < n_heads: query head h reads key/value head
    h // (n_heads / n_kv_heads). qk_norm: an RMSNorm over each query and key head before the
    rotary (Qwen3). The pieces `qkv` and `out` are what context parallelism reuses.
    """

    def __init__(self, d_model: int, n_heads: int, *, bias: bool = False, dropout: float = 0.0,
                 init_std: float = 0.02, out_init_std: float = 0.02, rope_theta=None,
                 n_kv_heads: int = 0, head_dim: int = 0, qk_norm: bool = False,
                 norm_eps: float = 1e-6):
        super().__init__()
        self.head_dim = head_dim or d_model // n_heads
        self.rope_dim = self.head_dim
        self.groups = n_heads // (n_kv_heads or n_heads)
        self.dropout = dropout
        self.rope_theta = rope_theta  # None: no rotary positions
        hd, kv = self.head_dim, (n_kv_heads or n_heads) * self.head_dim
        self.wq = Linear(d_model, n_heads * hd, bias, init_std)
        self.wk = Linear(d_model, kv, bias, init_std)
        self.wv = Linear(d_model, kv, bias, init_std)
        self.wo = Linear(n_heads * hd, d_model, bias, out_init_std)
        self.q_norm = RMSNorm(hd, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, eps=norm_eps) if qk_norm else None

    def _heads(self, x_BSD: torch.Tensor, width: int = 0) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        return x_BSD.view(B, S, -1, width or self.head_dim).transpose(1, 2)

    def qkv(self, x_BSD, kv_BLD=None, cos_SH=None, sin_SH=None, repeat: bool = True) -> tuple:
        """Query, key and value heads [B, H, S or L, Dh], rotary applied with the given tables
        (None: none); keys/values repeated to every query head (repeat=False: one per kv head,
        what a KV cache keeps)."""
        kv = x_BSD if kv_BLD is None else kv_BLD
        if not _share_cast(self.wq, self.wk, self.wv):   # CPU's FP8 Linears take x as it is
            x_q, x_k, x_v = x_BSD, kv, kv
        elif kv_BLD is None:   # self-attention: one low-precision copy for the three (cast_once.py)
            x_q, x_k, x_v = readers(x_BSD, 3)
        else:
            x_q, (x_k, x_v) = x_BSD, readers(kv_BLD, 2)
        q, k, v = self._heads(self.wq(x_q)), self._heads(self.wk(x_k)), self._heads(self.wv(x_v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos_SH is not None:
            q, k = apply_rope(q, cos_SH, sin_SH), apply_rope(k, cos_SH, sin_SH)
        return (q, *self.repeat_kv(k, v)) if repeat else (q, k, v)

    def repeat_kv(self, k, v) -> tuple:
        """Key/value heads repeated to every query head (grouped-query attention)."""
        if self.groups > 1:
            k, v = k.repeat_interleave(self.groups, 1), v.repeat_interleave(self.groups, 1)
        return k, v

    def out(self, o_BHSD: torch.Tensor) -> torch.Tensor:
        B, _, S, _ = o_BHSD.shape
        return self.wo(o_BHSD.transpose(1, 2).reshape(B, S, -1))

    def forward(self, x_BSD, kv_BLD=None, bias_1HSL=None, causal: bool = False, cache=None):
        """cache (models/kv_cache.LayerKV, inference): x holds the tokens after the cached ones;
        their keys and values join the cache and the queries attend to all of it."""
        if cache is not None:
            return self._cached(x_BSD, cache)
        cos = sin = None
        if self.rope_theta is not None:
            cos, sin = rope_cos_sin(x_BSD.shape[1], self.rope_dim, self.rope_theta, x_BSD.device)
        q, k, v = self.qkv(x_BSD, kv_BLD, cos, sin, repeat=False)  # core() repeats if it must
        mask = None
        if bias_1HSL is not None:
            mask = bias_1HSL.to(q.dtype)
            if causal:
                S, L = q.shape[2], k.shape[2]
                future_SL = torch.ones(S, L, dtype=torch.bool, device=q.device).triu(1)
                mask = mask.masked_fill(future_SL, float("-inf"))
        o_BHSD = self.core(q, k, v, mask, causal and mask is None)
        return self.out(o_BHSD)

    def core(self, q, k, v, mask, is_causal: bool) -> torch.Tensor:
        """The attention core, softmax(q k^T / sqrt(d) + mask) v with dropout: what
        parallel.recompute_modules=core_attn recomputes in backward. k, v may hold one head
        per kv head (grouped-query attention): a flash kernel reads each for its query heads,
        so nothing is repeated and the kernel saves them as they are (1/groups of the
        repeated bytes); elsewhere they are repeated first."""
        p = self.dropout if self.training else 0.0
        grouped = k.shape[1] != q.shape[1]
        if grouped and not flash_reads_kv_groups(q, mask):
            k, v = self.repeat_kv(k, v)
            grouped = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal,
                                              enable_gqa=grouped)

    def _cached(self, x_BSD, cache):
        """Causal self-attention of S new tokens at positions [P, P+S) after P cached ones."""
        P, S = cache.length, x_BSD.shape[1]
        cos = sin = None
        if self.rope_theta is not None:
            cos, sin = rope_cos_sin(P + S, self.rope_dim, self.rope_theta, x_BSD.device)
            cos, sin = cos[P:], sin[P:]
        q, k, v = self.qkv(x_BSD, None, cos, sin, repeat=False)
        k, v = self.repeat_kv(*cache.extend(k, v))
        mask_SL = None
        if S > 1:  # new query i sees keys [0, P + i]
            L = P + S
            mask_SL = torch.ones(S, L, dtype=torch.bool, device=q.device).tril(P)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask_SL))


class LatentAttention(Attention):
    """DeepSeek's multi-head latent attention (MLA), self-attention only.

    Shapes: C kv_lora_rank, Cq q_lora_rank, N non-rotary width (head_dim), R rotary width,
    Dv value width. Queries: wq (or wq_a -> q_a_norm -> wq_b when q_lora_rank > 0) give
    [B, H, S, N + R]; keys and values come from one latent: wkv_a gives [C + R], the C part
    normalised (kv_norm) and expanded by wkv_b into per-head [N + Dv], the R part one rotary
    key shared by every head. The rotary turns the R parts only; scores use N + R channels
    (softmax scale 1/sqrt(N + R)). A YaRN-scaled rotary (the published long-context
    extension) is not reproduced: positions use plain RoPE at rope_theta.
    """

    def __init__(self, m, *, init_std: float, out_init_std: float):
        nn.Module.__init__(self)
        H, D = m.n_heads, m.d_model
        self.head_dim, self.rope_dim, self.v_dim = m.nope_dim, m.qk_rope_head_dim, m.v_dim
        self.kv_rank, self.groups, self.dropout, self.rope_theta = m.kv_lora_rank, 1, m.dropout, m.rope_theta
        self.q_norm = self.k_norm = None  # no per-head norm (the latents have their own)
        qk, self.q_lora = m.qk_dim, m.q_lora_rank > 0
        if self.q_lora:
            self.wq_a = Linear(D, m.q_lora_rank, False, init_std)
            self.q_a_norm = RMSNorm(m.q_lora_rank, eps=m.norm_eps)
            self.wq_b = Linear(m.q_lora_rank, H * qk, False, init_std)
        else:
            self.wq = Linear(D, H * qk, False, init_std)
        self.wkv_a = Linear(D, m.kv_lora_rank + self.rope_dim, False, init_std)
        self.kv_norm = RMSNorm(m.kv_lora_rank, eps=m.norm_eps)
        self.wkv_b = Linear(m.kv_lora_rank, H * (self.head_dim + self.v_dim), False, init_std)
        self.wo = Linear(H * self.v_dim, D, False, out_init_std)

    def qkv(self, x_BSD, kv_BLD=None, cos_SH=None, sin_SH=None, repeat: bool = True) -> tuple:
        if kv_BLD is not None:
            raise ValueError("model.attention='mla' is self-attention only")
        N, R = self.head_dim, self.rope_dim
        first = self.wq_a if self.q_lora else self.wq
        # one low-precision copy for both (cast_once.py); CPU's FP8 Linears take x as it is
        x_q, x_kv = readers(x_BSD, 2) if _share_cast(first, self.wkv_a) else (x_BSD, x_BSD)
        q_a = self.wq_a(x_q) if self.q_lora else None
        latent_C, k_rot = self.wkv_a(x_kv).split([self.kv_rank, R], dim=-1)
        q_lin, kv_lin = self.up(x_q if q_a is None else q_a, latent_C)
        q_nope, q_rot = self._heads(q_lin, N + R).split([N, R], dim=-1)
        k_nope, v = self._heads(kv_lin, N + self.v_dim).split([N, self.v_dim], dim=-1)
        k_rot = k_rot.unsqueeze(1)                                   # [B, 1, S, R]
        if cos_SH is not None:
            q_rot, k_rot = apply_rope(q_rot, cos_SH, sin_SH), apply_rope(k_rot, cos_SH, sin_SH)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        return q, k, v.contiguous()

    def up(self, q_in, latent_C) -> tuple:
        """The up-projections: queries from the query latent (q_lora_rank > 0; else wq from
        the input itself), per-head keys and values from the normalised kv latent. What
        parallel.recompute_modules=mla_up_proj recomputes in backward (the normalised
        latents and the projections are then not kept)."""
        q_lin = self.wq_b(self.q_a_norm(q_in)) if self.q_lora else self.wq(q_in)
        return q_lin, self.wkv_b(self.kv_norm(latent_C))


def _share_cast(*mods) -> bool:
    """Whether the projections take readers()' one low-precision copy of their input: this
    file's Linears (autocast casts it for each), and torchao's FP8 Linears (parallel/fp8.py)
    under CUDA's autocast, the one they read (torch.is_autocast_enabled()): they cast their
    input to its dtype and keep that cast, so given the copy their cast is a no-op and they
    keep the one copy, not one each. Elsewhere (CPU) they quantize the input as it is."""
    return all(type(m) is Linear for m in mods) or torch.is_autocast_enabled()


def flash_reads_kv_groups(q: torch.Tensor, mask) -> bool:
    """Whether scaled_dot_product_attention's flash kernel runs grouped-query attention
    (enable_gqa) for these inputs, with no repeated keys and values: without an additive
    mask, on the CPU's flash kernel (measured equal to the repeated form) and on CUDA's for
    bf16/fp16 with a head dim of at most 256 (the memory-efficient and cuDNN kernels take no
    groups, and torch's fallback then is the quadratic-memory math kernel, so any other
    case repeats them instead). Static facts only: it traces under torch.compile."""
    if mask is not None:
        return False
    if q.device.type == "cpu":
        return True
    return q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256


def make_attention(m, out_std: float) -> nn.Module:
    """The GPT block's self-attention of ModelConfig `m` (mha/gqa or mla)."""
    if m.attention == "mla":
        return LatentAttention(m, init_std=m.init_std, out_init_std=out_std)
    rope = m.rope_theta if m.positions == "rope" else None
    return Attention(m.d_model, m.n_heads, bias=m.bias, dropout=m.dropout, init_std=m.init_std,
                     out_init_std=out_std, rope_theta=rope, n_kv_heads=m.n_kv_heads,
                     head_dim=m.head_dim, qk_norm=m.qk_norm, norm_eps=m.norm_eps)


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
