"""Switch-Transformer-style encoder-decoder (T5-like): relative position bias, RMSNorm, no
biases, MoE FFN in every `moe.every`-th block of both stacks, trained on span corruption.

Shapes: B batch, S encoder length, T decoder length, L key length, D model dim, H heads,
V vocab, U relative-position buckets.

Structure: tok_emb (shared by both stacks), encoder / decoder (Stack: rel_bias, blocks,
norm), lm_head (tied to tok_emb when model.tie_embeddings). Attention uses the usual
1/sqrt(head_dim) scaling (T5 folds it into the init instead; the function class is the same).
"""
import math

import torch
import torch.nn as nn

from .layers import Attention, Embedding, Linear, make_ffn, make_norm, out_init_std


def relative_position_bucket(rel_SL: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5 bucketing of (key - query) offsets: exact for short distances, log-spaced beyond,
    everything past max_distance in the last bucket. Bidirectional uses half the buckets for
    keys after the query. Causal (decoder) maps every future offset to bucket 0."""
    dist_SL = -rel_SL  # > 0 for keys before the query
    bucket_SL = torch.zeros_like(rel_SL)
    if bidirectional:
        num_buckets //= 2
        bucket_SL = bucket_SL + (dist_SL < 0).long() * num_buckets
        dist_SL = dist_SL.abs()
    else:
        dist_SL = dist_SL.clamp_min(0)
    exact = num_buckets // 2
    # log-spaced buckets for exact <= d < max_distance; clamp(1) avoids log(0) in unused lanes
    log_ratio = torch.log(dist_SL.float().clamp_min(1) / exact) / math.log(max_distance / exact)
    large_SL = (exact + (log_ratio * (num_buckets - exact)).long()).clamp_max(num_buckets - 1)
    return bucket_SL + torch.where(dist_SL < exact, dist_SL, large_SL)


class RelativePositionBias(nn.Module):
    """Learned per-head scalar bias for each relative-position bucket, shared by all blocks."""

    def __init__(self, n_heads: int, num_buckets: int, max_distance: int, bidirectional: bool,
                 init_std: float):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional
        self.emb = Embedding(num_buckets, n_heads, init_std)

    def forward(self, S: int, L: int, device) -> torch.Tensor:
        rel_SL = torch.arange(L, device=device)[None, :] - torch.arange(S, device=device)[:, None]
        bucket_SL = relative_position_bucket(rel_SL, self.bidirectional, self.num_buckets,
                                             self.max_distance)
        return self.emb(bucket_SL).permute(2, 0, 1).unsqueeze(0)  # [1, H, S, L]


class EncoderBlock(nn.Module):
    def __init__(self, m, moe_cfg, idx: int):
        super().__init__()
        out_std = out_init_std(m)
        self.attn_norm = make_norm(m.norm, m.d_model, m.norm_eps)
        self.attn = Attention(m.d_model, m.n_heads, dropout=m.dropout, init_std=m.init_std,
                              out_init_std=out_std)
        self.ffn_norm = make_norm(m.norm, m.d_model, m.norm_eps)
        self.ffn = make_ffn(m, moe_cfg, idx, out_std, bias=False)
        self.drop = nn.Dropout(m.dropout)

    def forward(self, x_BSD, bias_BHSS):
        x_BSD = x_BSD + self.drop(self.attn(self.attn_norm(x_BSD), bias_1HSL=bias_BHSS))
        return x_BSD + self.drop(self.ffn(self.ffn_norm(x_BSD)))


class DecoderBlock(nn.Module):
    def __init__(self, m, moe_cfg, idx: int):
        super().__init__()
        out_std = out_init_std(m)
        self.attn_norm = make_norm(m.norm, m.d_model, m.norm_eps)
        self.attn = Attention(m.d_model, m.n_heads, dropout=m.dropout, init_std=m.init_std,
                              out_init_std=out_std)
        self.cross_norm = make_norm(m.norm, m.d_model, m.norm_eps)
        self.cross_attn = Attention(m.d_model, m.n_heads, dropout=m.dropout, init_std=m.init_std,
                                    out_init_std=out_std)
        self.ffn_norm = make_norm(m.norm, m.d_model, m.norm_eps)
        self.ffn = make_ffn(m, moe_cfg, idx, out_std, bias=False)
        self.drop = nn.Dropout(m.dropout)

    def forward(self, x_BTD, bias_1HTT, enc_BSD, enc_mask_B11S):
        x_BTD = x_BTD + self.drop(self.attn(self.attn_norm(x_BTD), bias_1HSL=bias_1HTT, causal=True))
        x_BTD = x_BTD + self.drop(self.cross_attn(self.cross_norm(x_BTD), kv_BLD=enc_BSD,
                                                  bias_1HSL=enc_mask_B11S))
        return x_BTD + self.drop(self.ffn(self.ffn_norm(x_BTD)))


class Stack(nn.Module):
    def __init__(self, m, moe_cfg, decoder: bool):
        super().__init__()
        block = DecoderBlock if decoder else EncoderBlock
        self.rel_bias = RelativePositionBias(m.n_heads, m.rel_pos_buckets, m.rel_pos_max_distance,
                                             bidirectional=not decoder, init_std=m.init_std)
        self.blocks = nn.ModuleList(block(m, moe_cfg, i) for i in range(m.n_layers))
        self.norm = make_norm(m.norm, m.d_model, m.norm_eps)
        self.drop = nn.Dropout(m.dropout)


def _key_mask_bias(attention_mask_BS, dtype):
    """1/0 key mask [B, S] -> additive bias [B, 1, 1, S] (0 keep, -inf drop), or None."""
    if attention_mask_BS is None:
        return None
    keep = attention_mask_BS.bool()[:, None, None, :]
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


class Switch(nn.Module):
    def __init__(self, model_cfg, moe_cfg):
        super().__init__()
        m = model_cfg
        self.model_cfg, self.moe_cfg = model_cfg, moe_cfg
        self.tok_emb = Embedding(m.vocab_size, m.d_model, m.init_std)
        self.encoder = Stack(m, moe_cfg, decoder=False)
        self.decoder = Stack(m, moe_cfg, decoder=True)
        self.lm_head = Linear(m.d_model, m.vocab_size, bias=False, init_std=m.init_std)
        if m.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def _check(self, ids, name):
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be integer token ids of shape [B, S], got "
                             f"{tuple(ids.shape)} {ids.dtype}")
        if ids.shape[1] > self.model_cfg.max_seq_len:
            raise ValueError(f"{name} has length {ids.shape[1]} > model.max_seq_len="
                             f"{self.model_cfg.max_seq_len}; raise model.max_seq_len")

    def encode(self, input_ids_BS, attention_mask_BS=None):
        self._check(input_ids_BS, "input_ids")
        enc = self.encoder
        x_BSD = enc.drop(self.tok_emb(input_ids_BS))
        S = x_BSD.shape[1]
        bias = enc.rel_bias(S, S, x_BSD.device).to(x_BSD.dtype)
        key_bias = _key_mask_bias(attention_mask_BS, x_BSD.dtype)
        if key_bias is not None:
            bias = bias + key_bias
        for block in enc.blocks:
            x_BSD = block(x_BSD, bias)
        return enc.drop(enc.norm(x_BSD))

    def decode(self, decoder_input_ids_BT, enc_BSD, attention_mask_BS=None):
        self._check(decoder_input_ids_BT, "decoder_input_ids")
        dec = self.decoder
        y_BTD = dec.drop(self.tok_emb(decoder_input_ids_BT))
        T = y_BTD.shape[1]
        bias = dec.rel_bias(T, T, y_BTD.device).to(y_BTD.dtype)
        enc_mask = _key_mask_bias(attention_mask_BS, y_BTD.dtype)
        for block in dec.blocks:
            y_BTD = block(y_BTD, bias, enc_BSD, enc_mask)
        return dec.drop(dec.norm(y_BTD))

    def decode_logits(self, decoder_input_ids_BT, enc_BSD, attention_mask_BS=None):
        """Logits [B, T, V] of the target ids given encode's states."""
        return self.lm_head(self.decode(decoder_input_ids_BT, enc_BSD, attention_mask_BS))

    def forward(self, input_ids_BS, decoder_input_ids_BT, attention_mask_BS=None):
        """Encoder ids [B, S], decoder ids [B, T] (labels shifted right) -> logits [B, T, V].

        attention_mask_BS (optional, 1 = real token) hides encoder padding from attention.
        """
        enc_BSD = self.encode(input_ids_BS, attention_mask_BS)
        return self.decode_logits(decoder_input_ids_BT, enc_BSD, attention_mask_BS)
