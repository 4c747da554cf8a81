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

Tolerances (tests/tolerance.py). Every step of the reference starts from the layout's masters
after the step before (rule 4: the fp32 norm's sum order differs, so after a few steps a master
one fp32 rounding apart may round to the other bf16 neighbour -- on a CPU with avx512_bf16 and
no AMX it did at step 3, and the step-4 norm moved by 2.5e-5 -- and from then on two correct
runs differ by as much as the bug below). From the same weights the step's bf16 operations are
the same on the same shapes, so what is left is fp32 summation order:
- loss: the two halves' losses added in another order, sum_rtol(2) (1.4e-6);
- gradient norm: a sum of n squares, sum_rtol(n) (n ~ 8e4: 2.7e-4);
- masters: AdamW moves each by lr x (its gradient over its rms), which the clip scale's
  relative difference (at most the norm's) changes by at most lr x sum_rtol(n), plus the
  update's own fp32 roundings, 4u |w|: M_ATOL = lr x sum_rtol(n) + 4u max|w| (about 1e-6).
Measured (AMX, AVX512-bf16 and AVX2 kernels): loss 6e-8, norm 7e-8, masters 6e-8.
Also checked: every bf16 parameter exactly its master rounded to bf16; what each rank holds:
parameters in bf16, slices and optimizer state in fp32, ZeRO-2's gradient slices in bf16
(ZeRO-3: fp32 shards and state); and the ledger's bytes: the gradient all-reduce (ZeRO-1) or
reduce-scatter and the parameter all-gathers at 2 bytes an element, half the fp32 layout's.
Masters rounded to bf16 before each step fail this (measured: masters off by 2e-4 at step 0).
"""
import pytest
import torch

from parallel.precision import apply_precision
from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed
from tests.tolerance import sum_rtol, unit_roundoff

pytestmark = [pytest.mark.dist, pytest.mark.lowp]
BF16 = torch.bfloat16


def master_atol(n_grad: int, max_abs_weight: float) -> float:
    """The masters' bound from the same starting weights (module docstring)."""
    return dc.LR * sum_rtol(n_grad) + 4 * unit_roundoff(torch.float32) * max_abs_weight
LAYOUTS = [("dp2 zero1", {"dp": 2, "zero": 1}), ("dp2 zero2", {"dp": 2, "zero": 2}),
           ("dp2 zero3", {"dp": 2, "zero": 3})]


class _Reference:
    """The one-process loop, stepped from the layout's masters (tests/tolerance.py: a reference
    that performs the same operations on the same weights). clip_fp32: the gradients are made
    fp32 before clipping (ZeRO-3: FSDP2 hands over fp32 gradient shards), else clipped in bf16
    (ZeRO-1/2 clip the gradients they hold, in bf16)."""

    def __init__(self, model_cfg, moe_cfg, clip_fp32: bool):
        self.model = dc.make_model(model_cfg, moe_cfg)
        apply_precision(self.model, "bf16")
        self.params = dict(self.model.named_parameters())
        self.masters = {n: torch.nn.Parameter(p.detach().clone()) for n, p in self.params.items()}
        for p in self.params.values():
            p.data = p.data.to(BF16)
        self.opt = torch.optim.AdamW(self.masters.values(), lr=dc.LR, weight_decay=0.1)
        self.vocab, self.clip_fp32 = model_cfg.vocab_size, clip_fp32

    def load(self, masters: dict) -> None:
        """Start the next step from these fp32 masters ({name: full tensor}); the optimizer
        state stays the reference's own (it differs from the layout's by fp32 rounding only)."""
        with torch.no_grad():
            for n, m in masters.items():
                self.masters[n].copy_(m)
                self.params[n].copy_(m)

    def step(self, step: int):
        """(loss, grad_norm, n_grad_elements) of one step; the masters move."""
        x, y = dc.batch(step, self.vocab)
        loss = 0.0
        for half in (slice(0, dc.B // 2), slice(dc.B // 2, dc.B)):  # each rank's rows; the
            part = dc.task_loss(self.model(x[half]), y[half]) + dc.collect_aux_loss(self.model)
            part.backward()                                 # gradients accumulate (sum) in bf16
            loss += part.item() / 2
        grads = {n: p.grad.div_(2) for n, p in self.params.items() if p.grad is not None}
        norm = torch.stack([g.float().pow(2).sum() for g in grads.values()]).sum().sqrt()
        scale = torch.clamp(dc.CLIP / (norm + 1e-6), max=1.0)
        for n, g in grads.items():
            self.masters[n].grad = g.float().mul_(scale) if self.clip_fp32 else g.mul_(scale.to(BF16)).float()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.masters[n])
                p.grad = None
        return loss, norm.item(), sum(g.numel() for g in grads.values())

    def state(self) -> dict:
        return {n: m.detach().clone() for n, m in self.masters.items()}


def _worker(rank, world):
    model_cfg, moe_cfg = dc.configs()
    out = {}
    for name, spec in LAYOUTS:
        ref, ref_out, seen = _Reference(model_cfg, moe_cfg, clip_fp32=spec["zero"] == 3), [], []

        def step_reference(step, layout_masters):
            """The reference's step `step` from the masters the layout started it with; then
            the layout's masters after it become the reference's start of the next step."""
            loss, norm, n = ref.step(step)
            after = ref.state()
            ref_out.append((loss, norm, n, max(m.abs().max().item() for m in after.values())))
            ref.load(layout_masters)
            return after
        if spec["zero"] == 3:
            out[name] = (_fsdp_run(world, spec, model_cfg, moe_cfg, step_reference), ref_out)
            continue

        def inspect(par, opt, step, comm):
            masters = par.zero.full_masters()
            by_name = {n: masters[id(p)] for n, p in par.model.named_parameters()}
            ref_masters = step_reference(step, by_name)
            diffs, dtypes = [], set()
            for n, p in par.model.named_parameters():
                want = dc.my_block(n, ref_masters[n], par.meshes, par.plan)
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
        out[name] = ((losses, seen), ref_out)
    return out


def _fsdp_run(world, spec, model_cfg, moe_cfg, step_reference):
    """ZeRO-3: FSDP2 gathers bf16 casts of its fp32 shards (the masters) and reduce-scatters
    bf16 gradients; checked: the shards against the reference masters, their dtypes, and the
    gather and reduce-scatter bytes at 2 an element (of the shards' numel x dp)."""
    seen = []

    def inspect(par, opt, step, comm):
        full = {n: p.full_tensor() for n, p in par.model.named_parameters()}
        ref_masters = step_reference(step, full)
        diffs, dtypes = [], set()
        for n, p in par.model.named_parameters():
            want = dc.my_block(n, ref_masters[n], par.meshes, par.plan)
            diffs.append((n, (full[n] - want).abs().max().item(), True))
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
            assert len(losses) == len(ref) == len(seen) == dc.STEPS, (name, len(losses), len(ref))
            for step, ((l, g), (rl, rg, n_grad, _)) in enumerate(zip(losses, ref)):
                worst[name, "loss"] = max(worst.get((name, "loss"), 0), abs(l - rl) / abs(rl))
                worst[name, "norm"] = max(worst.get((name, "norm"), 0), abs(g - rg) / abs(rg))
                assert abs(l - rl) <= sum_rtol(2) * abs(rl), f"{name} step {step}: loss {l} vs {rl}"
                assert abs(g - rg) <= sum_rtol(n_grad) * abs(rg), f"{name} step {step}: norm {g} vs {rg}"
            for step, (diffs, dtypes, comm, L, n) in enumerate(seen):
                worst[name, "master"] = max([worst.get((name, "master"), 0)] + [d for _, d, _ in diffs])
                atol = master_atol(ref[step][2], ref[step][3])
                bad = [(p, f"{d:.2e}") for p, d, _ in diffs if d > atol]
                assert not bad, f"{name} rank {rank} step {step}: masters differ (> {atol:.1e}): {bad}"
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
