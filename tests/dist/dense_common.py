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


def make_model(model_cfg, moe_cfg, seed=0, dtype=torch.float32):
    model = build_model(model_cfg, moe_cfg, device="meta")
    model = init_weights(model, seed, torch.device("cpu"))
    return model if dtype == torch.float32 else model.to(dtype)  # fp32 keeps its fp64 buffers


def batch(step: int, vocab: int = 64):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (B, S + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def task_loss(logits_BSV, targets_BS):
    """Cross-entropy in fp32 at least (bf16/fp16 logits upcast; fp64 stays fp64)."""
    logits = logits_BSV.reshape(-1, logits_BSV.shape[-1])
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), targets_BS.reshape(-1))


def reference_run(model_cfg, moe_cfg, steps=STEPS, dtype=torch.float32):
    """[(loss, grad_norm)] of one process on the whole global batch (parameters in dtype)."""
    model = make_model(model_cfg, moe_cfg, dtype=dtype)
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


def one_process_grads(model_cfg, moe_cfg):
    """Logits and every gradient (by parameter name) of one process on step 0's global batch."""
    model = make_model(model_cfg, moe_cfg)
    x, y = batch(0, model_cfg.vocab_size)
    logits = model(x)
    (task_loss(logits, y) + collect_aux_loss(model)).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def my_block(name, ref_grad, meshes, plan):
    """This rank's part of a one-process gradient: experts [r*L, (r+1)*L) of the ep group,
    d_ff block j of the etp group; everything else whole (tp pieces compare as full tensors)."""
    from moe.expert_tp import FFN_DIMS, ffn_block
    if ".experts." not in name:
        return ref_grad
    L = ref_grad.shape[0] // plan.ep
    r, j = meshes.rank("ep"), meshes.rank("etp")
    block = ref_grad[r * L:(r + 1) * L]
    pname = name.rpartition(".")[2]
    return ffn_block(block, pname, j, plan.etp) if pname in FFN_DIMS and plan.etp > 1 else block


def one_step_check(world, spec, model_cfg, moe_cfg, grad_atol, grad_rtol, ref_moe_cfg=None):
    """One forward + backward of a layout on step 0's batch against one process:
    (max |logit diff| on this rank's dp share, [(name, max |grad diff|, atol + rtol * max|ref|)]
    for every parameter (none under ZeRO-2, whose sync leaves flat slices), ledger bytes by kind).
    ref_moe_cfg: the one process's MoE config when it differs (default moe_cfg)."""
    from parallel.apply import parallelize
    from parallel.dtensors import local
    from parallel.mesh import build_meshes
    from parallel.plan import ParallelPlan
    ref_logits, ref_grads = one_process_grads(model_cfg, ref_moe_cfg or moe_cfg)
    plan = ParallelPlan(**spec).validate(world, model_cfg, moe_cfg, B)
    meshes = build_meshes(plan)
    par = parallelize(make_model(model_cfg, moe_cfg), plan, meshes, loss_fn=task_loss)
    x, y = my_rows(par, *batch(0, model_cfg.vocab_size))
    dp_rank, n = par.dp_rank, B // plan.dp
    with par.recording_comm():
        logits = par.model(x)
        (task_loss(logits, y) + collect_aux_loss(par.model)).backward()
    comm = par.ledger.take()
    logits = local(logits.full_tensor() if hasattr(logits, "full_tensor") else logits)
    out_diff = (logits - par.split_sequence(ref_logits[dp_rank * n:(dp_rank + 1) * n])).abs().max().item()
    assert {name for name, _ in par.model.named_parameters()} == set(ref_grads)  # every gradient
    grads = []
    for name, p in par.model.named_parameters():
        if plan.zero == 2:
            break  # reduce-scattered into flat slices: the training steps check them
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = my_block(name, ref_grads[name], meshes, plan)
        assert g.shape == want.shape, (name, tuple(g.shape), tuple(want.shape))
        grads.append((name, (g - want).abs().max().item(), grad_atol + grad_rtol * want.abs().max().item()))
    return out_diff, grads, comm


def check_layouts(world, layouts, configs_of, grad_atol, grad_rtol, train_dtype=torch.float32) -> dict:
    """In a worker: {name: (one_step_check(...), train_layout(...))} for each (name, spec,
    variant) of `layouts`, the model configs from configs_of(variant); the training steps with
    parameters in train_dtype (fp64: tests/tolerance.py, rule 5)."""
    out = {}
    for name, spec, variant in layouts:
        model_cfg, moe_cfg = configs_of(variant)
        out[name] = (one_step_check(world, spec, model_cfg, moe_cfg, grad_atol, grad_rtol),
                     train_layout(world, spec, model_cfg, moe_cfg, dtype=train_dtype))
    return out


def clone(model):
    return copy.deepcopy(model)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def adamw_of(model):
    return adamw(model.parameters())


def train_layout(world, spec, model_cfg, moe_cfg, inspect=None, steps=STEPS, make_optimizer=adamw_of,
                 dtype=torch.float32):
    """[(loss, grad_norm)] of this rank training one layout (spec: ParallelPlan fields) for
    `steps` steps, each rank on its dp share of the global batch, with make_optimizer(model)
    (AdamW by default), parameters in dtype. inspect(par, optimizer, step, comm_bytes) is
    called after each step, with the bytes the ledger counted in it."""
    from parallel.apply import parallelize
    from parallel.mesh import build_meshes
    from parallel.plan import ParallelPlan
    plan = ParallelPlan(**spec).validate(world, model_cfg, moe_cfg, B)
    meshes = build_meshes(plan)
    par = parallelize(make_model(model_cfg, moe_cfg, dtype=dtype), plan, meshes, loss_fn=task_loss)
    model = par.model
    opt = par.prepare_optimizer(make_optimizer(model))
    out = []
    for step in range(steps):
        x, y = my_rows(par, *batch(step, model_cfg.vocab_size))
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
        dist.all_reduce(loss, group=meshes.group("dp"))  # the dp x cp replicas' equal parts
        out.append((loss.item() / plan.replicas, norm.item()))
    return out


def my_rows(par, x_BS, y_BS):
    """This rank's rows of the global batch (its dp row stream) and, under context
    parallelism, its part of each sequence."""
    n = B // par.plan.dp
    rows = slice(par.dp_rank * n, (par.dp_rank + 1) * n)
    return par.split_sequence(x_BS[rows]), par.split_sequence(y_BS[rows])


def assert_same_as_one_process(name, rank, out_diff, grads, losses, ref, out_atol, atol, rtol):
    """One rank's result against one process: logits within out_atol, every gradient within
    its bound (one_step_check's (name, diff, bound) rows), and per step the loss and the grad
    norm within atol + rtol x |reference|."""
    assert out_diff <= out_atol, f"{name} rank {rank}: logits differ by {out_diff:.2e}"
    bad = [(n, f"{d:.2e} > {b:.2e}") for n, d, b in grads if d > b]
    assert not bad, f"{name} rank {rank}: gradients differ: {bad}"
    assert len(losses) == len(ref), f"{name} rank {rank}: {len(losses)} steps, want {len(ref)}"
    for step, ((l, g), (rl, rg)) in enumerate(zip(losses, ref)):
        assert abs(l - rl) <= atol + rtol * abs(rl), f"{name} step {step}: loss {l} vs {rl}"
        assert abs(g - rg) <= atol + rtol * abs(rg), f"{name} step {step}: norm {g} vs {rg}"
