"""parallel.param_dtype=bf16 (the ZeRO paper's mixed precision: bf16 parameters and gradients,
fp32 master slices and optimizer state in ZeRO-1/2; under ZeRO-3 FSDP2 gathers bf16 casts of
its fp32 shards and reduce-scatters bf16 gradients) under dp2 with ZeRO 1, 2 and 3, against one
process written out by hand: the same tiny MoE GPT, weights and global batch under bf16
autocast, its parameters cast to bf16 after an fp32 copy was taken as the masters; each step
the two dp ranks' halves of the batch go through forward and backward one after the other
(the bf16 gradients accumulate, i.e. sum with one bf16 rounding, as the layout's bf16
all-reduce or reduce-scatter sums them) and are halved; global-norm clipping of the bf16
gradients (the norm in fp32); torch.optim.AdamW steps the masters on those gradients made
fp32; the parameters become the masters rounded to bf16. 5 steps. (ZeRO-3 clips the fp32
gradient shards FSDP2 hands over: the reference makes the gradients fp32 before clipping.)

The arithmetic is the same, so the check is tight: per step the loss and gradient norm within
1e-6 relative (the norm's fp32 sum order; measured 1.3e-7), every fp32 master (gathered from
the slices; ZeRO-3's shards) within 1e-6 (measured: equal under ZeRO-1/2, 6e-8 under ZeRO-3),
every bf16 parameter exactly its master rounded to bf16; what each rank holds: parameters in
bf16, slices and optimizer state in fp32, ZeRO-2's gradient slices in bf16 (ZeRO-3: fp32
shards and state); and the ledger's bytes: the gradient all-reduce (ZeRO-1) or reduce-scatter
and the parameter all-gathers at 2 bytes an element, half the fp32 layout's. Masters rounded
to bf16 before the first step fail this (measured: loss off by 2e-4 at step 1).
"""
import pytest
import torch

from parallel.precision import apply_precision
from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
BF16 = torch.bfloat16
L_RTOL, M_ATOL = 1e-6, 1e-6
LAYOUTS = [("dp2 zero1", {"dp": 2, "zero": 1}), ("dp2 zero2", {"dp": 2, "zero": 2}),
           ("dp2 zero3", {"dp": 2, "zero": 3})]


def _reference(model_cfg, moe_cfg, clip_fp32: bool):
    """[(loss, grad_norm)] and {name: fp32 master} after each step, one process; clip_fp32:
    the gradients are made fp32 before clipping (ZeRO-3: FSDP2 hands over fp32 gradient
    shards), else clipped in bf16 (ZeRO-1/2 clip the gradients they hold, in bf16)."""
    model = dc.make_model(model_cfg, moe_cfg)
    apply_precision(model, "bf16")
    params = dict(model.named_parameters())
    masters = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    for p in params.values():
        p.data = p.data.to(BF16)
    opt = torch.optim.AdamW(masters.values(), lr=dc.LR, weight_decay=0.1)
    out, seen = [], []
    for step in range(dc.STEPS):
        x, y = dc.batch(step, model_cfg.vocab_size)
        loss = 0.0
        for half in (slice(0, dc.B // 2), slice(dc.B // 2, dc.B)):  # each rank's rows; the
            part = dc.task_loss(model(x[half]), y[half]) + dc.collect_aux_loss(model)  # bf16
            part.backward()                                 # gradients accumulate (sum) in bf16
            loss += part.item() / 2
        for p in params.values():
            if p.grad is not None:
                p.grad.div_(2)
        grads = [p.grad for p in params.values() if p.grad is not None]
        norm = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()
        scale = torch.clamp(dc.CLIP / (norm + 1e-6), max=1.0)
        for n, p in params.items():
            if p.grad is not None:
                masters[n].grad = p.grad.float().mul_(scale) if clip_fp32 else p.grad.mul_(scale.to(BF16)).float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n])
                p.grad = None
        out.append((loss, norm.item()))
        seen.append({n: m.detach().clone() for n, m in masters.items()})
    return out, seen


def _worker(rank, world):
    model_cfg, moe_cfg = dc.configs()
    out, refs = {}, {clip: _reference(model_cfg, moe_cfg, clip) for clip in (False, True)}
    for name, spec in LAYOUTS:
        seen = []
        if spec["zero"] == 3:
            out[name] = (_fsdp_run(world, spec, model_cfg, moe_cfg, refs[True][1]), refs[True][0])
            continue
        ref_masters = refs[False][1]

        def inspect(par, opt, step, comm):
            masters = par.zero.full_masters()
            diffs, dtypes = [], set()
            for n, p in par.model.named_parameters():
                want = dc.my_block(n, ref_masters[step][n], par.meshes, par.plan)
                got = masters[id(p)]
                diffs.append((n, (got - want).abs().max().item(), torch.equal(p.detach(), got.to(BF16))))
                dtypes.add(("param", p.dtype))
            for sl in par.zero.slices:
                dtypes |= {("slice", s.dtype) for s in sl.shards}
                dtypes |= {("zero2 grad slice", g.dtype) for g in sl.low_grads if g is not None}
            dtypes |= {("state", v.dtype) for st in opt.state.values() for v in st.values()
                       if torch.is_tensor(v) and v.dim()}
            L = sum(sum(sl.L) for sl in par.zero.slices)
            n = sum(p.numel() for p in par.model.parameters())
            seen.append((diffs, sorted(map(str, dtypes)), comm, L, n))
        spec = dict(spec, precision="bf16", param_dtype="bf16")
        losses = dc.train_layout(world, spec, model_cfg, moe_cfg, inspect=inspect)
        out[name] = ((losses, seen), refs[False][0])
    return out


def _fsdp_run(world, spec, model_cfg, moe_cfg, ref_masters):
    """ZeRO-3: FSDP2 gathers bf16 casts of its fp32 shards (the masters) and reduce-scatters
    bf16 gradients; checked: the shards against the reference masters, their dtypes, and the
    gather and reduce-scatter bytes at 2 an element (of the shards' numel x dp)."""
    seen = []

    def inspect(par, opt, step, comm):
        diffs, dtypes = [], set()
        for n, p in par.model.named_parameters():
            want = dc.my_block(n, ref_masters[step][n], par.meshes, par.plan)
            diffs.append((n, (p.full_tensor() - want).abs().max().item(), True))
            dtypes.add(("param", p.dtype))
        dtypes |= {("state", v.dtype) for st in opt.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.dim()}
        shards = sum(p.to_local().numel() for p in par.model.parameters())
        seen.append((diffs, sorted(map(str, dtypes)), comm, shards, _root_numel(par.model)))
    losses = dc.train_layout(world, dict(spec, precision="bf16", param_dtype="bf16"), model_cfg,
                             moe_cfg, inspect=inspect)
    return losses, seen


def _root_numel(model) -> int:
    """Shard elements of the root FSDP2 unit's own parameters (gathered once: forward only)."""
    from torch.distributed.fsdp import FSDPModule
    inner = {id(p) for m in model.modules() if isinstance(m, FSDPModule) and m is not model
             for p in m.parameters()}
    return sum(p.to_local().numel() for p in model.parameters() if id(p) not in inner)


def test_bf16_parameters_with_fp32_masters_equal_one_process():
    results = run_distributed(_worker, 2, timeout=300)
    worst = {}
    for rank, out in enumerate(results):
        for name, ((losses, seen), ref) in out.items():
            for step, ((l, g), (rl, rg)) in enumerate(zip(losses, ref)):
                worst[name, "loss"] = max(worst.get((name, "loss"), 0), abs(l - rl) / abs(rl), abs(g - rg) / abs(rg))
                assert abs(l - rl) <= L_RTOL * abs(rl), f"{name} step {step}: loss {l} vs {rl}"
                assert abs(g - rg) <= L_RTOL * abs(rg), f"{name} step {step}: norm {g} vs {rg}"
            for step, (diffs, dtypes, comm, L, n) in enumerate(seen):
                worst[name, "master"] = max([worst.get((name, "master"), 0)] + [d for _, d, _ in diffs])
                bad = [(p, f"{d:.2e}") for p, d, _ in diffs if d > M_ATOL]
                assert not bad, f"{name} rank {rank} step {step}: masters differ: {bad}"
                unrounded = [p for p, _, same in diffs if not same]
                assert not unrounded, f"{name} step {step}: parameters are not their masters in bf16: {unrounded}"
                if name.endswith("zero3"):  # L: shard elements, n: the root unit's
                    assert set(dtypes) == {"('param', torch.float32)", "('state', torch.float32)"}, dtypes
                    assert comm["zero_grad_reduce_scatter"] == 2 * 2 * L, (comm, L)  # bf16, dp 2
                    assert comm["zero_param_gather"] == 2 * (L + L - n), (comm, L, n)  # fwd + bwd
                    continue
                want = {"('param', torch.bfloat16)", "('slice', torch.float32)", "('state', torch.float32)"}
                if name.endswith("zero2"):
                    want.add("('zero2 grad slice', torch.bfloat16)")
                assert set(dtypes) == want, (name, dtypes)
                reduced = {"dp2 zero1": ("dp_grad_reduce", 2 * n), "dp2 zero2": ("zero_grad_reduce_scatter", 2 * 2 * L)}
                assert comm[reduced[name][0]] == reduced[name][1], (name, comm, n, L)  # bf16: 2 bytes
                assert comm["zero_param_gather"] == 2 * L, (name, comm, L)
    print("worst relative loss/norm and absolute master differences:", worst)  # -s shows it
