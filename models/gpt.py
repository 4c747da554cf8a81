"""GPT-style decoder (GShard style): pre-norm blocks, MoE FFN in every k-th block.

Shapes: B batch, S sequence, D model dim, V vocab.

Structure (relied on by trainer and parallel/): tok_emb, pos_emb (None with RoPE), blocks
(nn.ModuleList of Block: attn_norm, attn, ffn_norm, ffn), norm, lm_head, and with
model.mtp_depth > 0 mtp (nn.ModuleList of models/mtp.MTPDepth). Any of tok_emb, norm, lm_head
may be set to None by a pipeline split: forward then skips it, so a stage maps hidden states
[B, S, D] to hidden states (or logits on the last stage).
"""
import torch
import torch.nn as nn

from .layers import Embedding, Linear, make_attention, make_ffn, make_norm, out_init_std
from .mtp import MTPDepth, mtp_losses, shifted_labels


class Block(nn.Module):
    """x + drop(attn(attn_norm(x))), then x + drop(ffn(ffn_norm(x)))."""

    def __init__(self, model_cfg, moe_cfg, idx: int):
        super().__init__()
        m, out_std = model_cfg, out_init_std(model_cfg)
        self.attn_norm = make_norm(m.norm, m.d_model, m.norm_eps, m.bias)
        self.attn = make_attention(m, out_std)
        self.ffn_norm = make_norm(m.norm, m.d_model, m.norm_eps, m.bias)
        self.ffn = make_ffn(m, moe_cfg, idx, out_std, m.bias)
        self.drop = nn.Dropout(m.dropout)

    def forward(self, x_BSD: torch.Tensor, cache=None) -> torch.Tensor:
        """cache: this block's models/kv_cache.LayerKV (inference), or None."""
        h_BSD = self.attn_norm(x_BSD)
        a_BSD = self.attn(h_BSD, causal=True) if cache is None else self.attn(h_BSD, cache=cache)
        x_BSD = x_BSD + self.drop(a_BSD)
        return x_BSD + self.drop(self.ffn(self.ffn_norm(x_BSD)))


class GPT(nn.Module):
    def __init__(self, model_cfg, moe_cfg):
        super().__init__()
        m = model_cfg
        self.model_cfg, self.moe_cfg = model_cfg, moe_cfg
        self.tok_emb = Embedding(m.vocab_size, m.d_model, m.init_std)
        self.pos_emb = Embedding(m.max_seq_len, m.d_model, m.init_std) if m.positions == "learned" else None
        self.drop = nn.Dropout(m.dropout)
        self.blocks = nn.ModuleList(Block(m, moe_cfg, i) for i in range(m.n_layers))
        self.norm = make_norm(m.norm, m.d_model, m.norm_eps, m.bias)
        self.lm_head = Linear(m.d_model, m.vocab_size, bias=False, init_std=m.init_std)
        if m.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # each depth's block is as the last block is (dense or MoE), as Megatron-Core builds it
        self.mtp = nn.ModuleList(MTPDepth(m, Block(m, moe_cfg, m.n_layers - 1))
                                 for _ in range(m.mtp_depth)) if m.mtp_depth else None
        self.mtp_labels = shifted_labels  # context parallelism shifts across its ranks instead
        self.mtp_loss = None  # [K] cross entropies of the last forward given labels (mtp.py)

    def forward(self, input_ids_BS: torch.Tensor, cache=None, labels_BS=None) -> torch.Tensor:
        """Token ids [B, S] -> logits [B, S, V] (or hidden states on a pipeline stage).

        cache (inference, models/kv_cache.KVCache from new_cache): the ids continue the cached
        positions; their keys and values are appended to it.
        labels_BS (training, with mtp): the next-token targets; the MTP depths then run and
        leave their cross entropies [K] in self.mtp_loss (the trainer weights and adds them,
        as it does the MoE layers' aux_loss). The logits are the main model's either way."""
        h_BSD = self.hidden(input_ids_BS, cache)
        self.mtp_loss = None
        if self.mtp is not None and labels_BS is not None:
            self.mtp_loss = mtp_losses(self, h_BSD, labels_BS)
        return self.logits(h_BSD)

    def hidden(self, input_ids_BS: torch.Tensor, cache=None) -> torch.Tensor:
        """The last block's output [B, S, D] (before the final norm; what MTP depth 1 reads)."""
        h_BSD = input_ids_BS
        if self.tok_emb is not None:
            # context parallelism replaces embed with a one-argument function (no cache there)
            h_BSD = self.embed(input_ids_BS) if cache is None else self.embed(input_ids_BS, cache.length)
        for i, block in enumerate(self.blocks):
            h_BSD = block(h_BSD) if cache is None else block(h_BSD, cache.layers[i])
        return h_BSD

    def logits(self, h_BSD: torch.Tensor) -> torch.Tensor:
        """The final norm and the head (each skipped where a pipeline split removed it)."""
        if self.norm is not None:
            h_BSD = self.norm(h_BSD)
        if self.lm_head is not None:
            h_BSD = self.lm_head(h_BSD)
        return h_BSD

    def new_cache(self):
        """An empty KV cache for forward(..., cache=)."""
        from .kv_cache import KVCache
        return KVCache(len(self.blocks))

    def embed(self, input_ids_BS: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Token (and learned position) embeddings of ids at positions [start, start + S)."""
        if input_ids_BS.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"GPT expects integer token ids [B, S], got dtype {input_ids_BS.dtype}")
        S = input_ids_BS.shape[-1]
        if start + S > self.model_cfg.max_seq_len:
            raise ValueError(f"sequence length {start + S} exceeds model.max_seq_len="
                             f"{self.model_cfg.max_seq_len}; raise model.max_seq_len or shorten the data")
        x_BSD = self.tok_emb(input_ids_BS)
        if self.pos_emb is not None:
            x_BSD = x_BSD + self.pos_emb(torch.arange(start, start + S, device=input_ids_BS.device))
        return self.drop(x_BSD)
