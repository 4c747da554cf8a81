"""Shared pieces of the dense-parallel equivalence tests: a tiny MoE GPT, a fixed global
batch, the one-process reference loop and the per-rank loop of one layout.

Shapes: B global batch (sequences), S sequence length, V vocab.
Every layout trains the same weights (same seed) on the same global batch for a few AdamW
steps with global-norm clipping; the per-step loss (mean over the global batch, plus the
summed aux losses) and grad norm must match the one-process run.
"""
import copy

import torch
import torch.nn.functional as F

from models import build_model, init_weights
from models.config import ModelConfig, MoEConfig
from moe.aux import collect_aux_loss

B, S, STEPS, LR, CLIP = 8, 16, 5, 3e-3, 0.5


def configs(n_layers=4, num_experts=4, top_k=2, positions="rope", tie=True):
    model_cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=n_layers, n_heads=4, d_ff=64,
                            max_seq_len=S, positions=positions, tie_embeddings=tie)
    moe_cfg = MoEConfig(num_experts=num_experts, top_k=top_k, every=2)
    return model_cfg, moe_cfg


def make_model(model_cfg, moe_cfg, seed=0):
    model = build_model(model_cfg, moe_cfg, device="meta")
    return init_weights(model, seed, torch.device("cpu"))


def batch(step: int, vocab: int = 64):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (B, S + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def task_loss(logits_BSV, targets_BS):
    return F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(), targets_BS.reshape(-1))


def reference_run(model_cfg, moe_cfg, steps=STEPS):
    """[(loss, grad_norm)] of one process on the whole global batch."""
    model = make_model(model_cfg, moe_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out = []
    for step in range(steps):
        x, y = batch(step, model_cfg.vocab_size)
        loss = task_loss(model(x), y) + collect_aux_loss(model)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss.item(), norm.item()))
    return out


def clone(model):
    return copy.deepcopy(model)
