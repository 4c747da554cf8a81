"""Shared pieces of the dense-parallel equivalence tests: a tiny MoE GPT, a fixed global
batch, the one-process reference loop and the per-rank loop of one layout.

Shapes: B global batch (sequences), S sequence length, V vocab.
Every layout trains the same weights (same seed) on the same global batch for a few AdamW
steps with global-norm clipping; the per-step loss (mean over the global batch, plus the
summed aux losses) and grad norm must match the one-process run.
"""
import copy

import torch
import torch.distributed as dist
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


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def train_layout(world, spec, model_cfg, moe_cfg, inspect=None, steps=STEPS, make_optimizer=adamw):
    """[(loss, grad_norm)] of this rank training one layout (spec: ParallelPlan fields) for
    `steps` steps, each rank on its dp share of the global batch. inspect(par, optimizer,
    step, comm_bytes) is called after each step, with the bytes the ledger counted in it."""
    from parallel.apply import parallelize
    from parallel.mesh import build_meshes
    from parallel.plan import ParallelPlan
    plan = ParallelPlan(**spec).validate(world, model_cfg, moe_cfg, B)
    meshes = build_meshes(plan)
    par = parallelize(make_model(model_cfg, moe_cfg), plan, meshes, loss_fn=task_loss)
    model = par.model
    opt = par.prepare_optimizer(make_optimizer(model.parameters()))
    dp_rank, n = meshes.rank("dp"), B // plan.dp
    out = []
    for step in range(steps):
        x, y = batch(step, model_cfg.vocab_size)
        x, y = x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]
        with par.recording_comm():
            if plan.pp > 1:
                loss = par.pipeline_step(x, y)
            else:
                loss = task_loss(model(x), y) + collect_aux_loss(model)
                loss.backward()
            norm = par.clip_grad_norm_(CLIP)
            opt.step()
        comm = par.ledger.take()
        if inspect is not None:
            inspect(par, opt, step, comm)
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=meshes.group("dp"))
        out.append((loss.item() / plan.dp, norm.item()))
    return out
