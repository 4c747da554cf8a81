"""parallel.precision=fp8 (parallel/fp8.py): what is converted and what is kept, the expert
banks' FP8 path against the hand composition of moe/fp8.py's quantizers, FP8 against bf16
within stated bounds (one GEMM: the rigorous per-element bound; the whole model: a stated
drift), and the refusals."""
import dataclasses

import pytest
import torch

from moe.experts import ExpertBank
from moe.fp8 import fp8_matmul
from tests.tolerance import max_rel_err
from tests.unit.fp8_reference import HandFP8Matmul

pytestmark = pytest.mark.lowp
U_E4M3 = 2.0 ** -4     # e4m3's unit roundoff: 3 mantissa bits, round to nearest
U_BF16 = 2.0 ** -8


def _model(over=()):
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    return workload_from_config(load_config(None, list(over))).build_model()


def test_fp8_converts_the_blocks_linears_and_banks_and_keeps_head_router_names_and_init():
    from models.build import init_weights
    from parallel.fp8 import apply_fp8
    model, ref = _model(), _model()
    keys = list(model.state_dict())
    apply_fp8(model, "tensorwise")
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    assert all(kinds[f"blocks.{i}.attn.{p}"] == "Float8Linear" for i in range(4) for p in ("wq", "wk", "wv", "wo"))
    assert kinds["lm_head"] == "Linear"                     # the head stays bf16
    banks = [m for m in model.modules() if isinstance(m, ExpertBank)]
    assert len(banks) == 4 and all(b.fp8 for b in banks)   # 2 MoE layers' experts, 2 dense FFNs
    assert list(model.state_dict()) == keys                 # checkpoints keep their names
    init_weights(model, 0), init_weights(ref, 0)            # the toolkit's N(0, std) init kept
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    wq = model.blocks[0].attn.wq
    assert wq.config.cast_config_weight.scaling_granularity.name == "TENSORWISE"
    apply_fp8(rowwise := _model(), "rowwise")
    assert rowwise.blocks[0].attn.wq.config.cast_config_weight.scaling_granularity.name == "AXISWISE"


def test_bank_fp8_path_is_the_hand_composition_per_expert():
    """Expert e's rows: h = fp8(x_e, w1[e]), h3 = fp8(x_e, w3[e]), y = fp8(silu(h) h3, w2[e])
    (bf16 in between, under autocast); an expert with no rows is skipped."""
    torch.manual_seed(0)
    bank = ExpertBank(3, 128, 256, "swiglu")
    bank.set_fp8(True)
    x = torch.randn(9, 128)
    counts = [4, 0, 5]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = bank(x, counts)
    xs, want = x.bfloat16().split(counts), []
    for e in (0, 2):
        h = fp8_matmul(xs[e], bank.w1[e].detach())
        h3 = fp8_matmul(xs[e], bank.w3[e].detach())
        want.append(fp8_matmul(torch.nn.functional.silu(h) * h3, bank.w2[e].detach()))
    assert y.dtype == torch.bfloat16 and torch.equal(y.detach(), torch.cat(want))
    y.float().sum().backward()
    assert bank.w1.grad[1].abs().sum() == 0 and bank.w1.grad[0].abs().sum() > 0


def test_one_fp8_gemm_is_within_the_rounding_bound_of_the_exact_one():
    """|fp8(x) fp8(w) - x w| <= (2u + u^2) |x| |w| per element (u = 2^-4: each operand off by
    at most u relative; fp32 accumulation adds nothing at this scale), and the norm error of
    random data is far below it (measured about u / 2)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g), torch.randn(256, 128, generator=g)
    err = (fp8_matmul(x, w) - x @ w).abs()
    bound = (2 * U_E4M3 + U_E4M3 ** 2) * (x.abs() @ w.abs()) * (1 + 1e-5)
    assert (err <= bound).all()
    rel = (fp8_matmul(x, w) - x @ w).norm() / (x @ w).norm()
    assert rel < U_E4M3


class _SameForward(torch.autograd.Function):
    """fp8_matmul's own forward (bit for bit, so the whole forward is the FP8 run's) with
    another backward: `hand` DeepSeek-V3's FP8 backward written out in
    tests/unit/fp8_reference.py, `bf16` the unquantized operands in bf16, fp32 sums."""

    @staticmethod
    def forward(ctx, x, w, kind):
        ctx.save_for_backward(x, w)
        ctx.kind = kind
        with torch.no_grad():
            return fp8_matmul(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        if ctx.kind == "hand":
            dx, dw, _ = HandFP8Matmul.backward(ctx, dy)
            return dx, dw, None
        with torch.autocast(dy.device.type, enabled=False):
            dx = dy.bfloat16() @ w.bfloat16().mT
            dw = x.bfloat16().mT @ dy.bfloat16()
        return dx.to(x.dtype), dw.to(w.dtype), None


def _loss_and_grads(precision, tokens, backward=None):
    """One batch through the default model in `precision` (fp8: the banks' backward replaced
    by _SameForward's `backward` where given): (loss, {name: grad}, names of bank weights)."""
    import moe.experts as experts
    from models.build import init_weights
    from parallel.fp8 import apply_fp8
    from parallel.precision import apply_precision
    model = _model()
    apply_precision(model, precision)
    if precision == "fp8":
        apply_fp8(model, "tensorwise")
    init_weights(model, 0)
    real = experts.fp8_matmul
    if backward is not None:
        experts.fp8_matmul = lambda x, w: _SameForward.apply(x, w, backward)
    try:
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    finally:
        experts.fp8_matmul = real
    banks = [f"{n}.{w}" for n, m in model.named_modules() if isinstance(m, ExpertBank)
             for w, _ in m.named_parameters()]
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.grad is not None}, banks


def test_whole_model_fp8_against_bf16_loss_and_gradients():
    """The default model on one batch (cross-entropy of its logits): FP8's loss within 2% of
    bf16's, every parameter's gradient within cosine 0.95 of bf16's and the routers' within
    0.90 (the stated drift: each GEMM on a path rounds both operands by up to u = 6%; a
    router's gradient is a difference of expert outputs, each off by that rounding, so it is
    the noisiest. Measured: cosine 0.97-0.99 for the GEMM weights, 0.93 and 0.96 for the two
    routers).
    That drift cannot tell an FP8 backward from a bf16 one (forward rounding dominates it:
    a bf16 backward also measures cosine > 0.97), so the banks' backward is held to two
    counterfactual runs of the same FP8 forward, bit for bit, with only the banks' backward
    swapped (_SameForward): every bank weight's gradient is within 2^-6 (norm-relative) of
    the run whose backward is the hand-written FP8 one (fp32 against float64 sums, and the
    e4m3 roundings those flip upstream; measured <= 2.3e-3) and more than 2^-6 from the run
    with a bf16 backward (FP8's rounding of both operands, u = 2^-4, against bf16's 2^-8:
    measured 3.5e-2 to 7.1e-2; a bf16 backward is 0 there). The last FP8 GEMM's weight
    gradient (blocks.3 experts' w2: the same operands, bit for bit, both ways) matches the
    hand FP8 backward to 1e-4 of its largest value, sum order only (measured 4e-7; a bf16
    backward is 4.8e-2 off)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4, 65))
    lb, gb, _ = _loss_and_grads("bf16", tokens)
    lf, gf, banks = _loss_and_grads("fp8", tokens)
    assert abs(lf - lb) <= 0.02 * abs(lb)
    assert gb.keys() == gf.keys()
    for n in gb:
        cos = torch.nn.functional.cosine_similarity(gb[n].flatten(), gf[n].flatten(), dim=0)
        floor = 0.90 if "router" in n else 0.95
        assert cos > floor, (n, cos.item())
    lh, gh, _ = _loss_and_grads("fp8", tokens, backward="hand")
    l16, g16, _ = _loss_and_grads("fp8", tokens, backward="bf16")
    assert lh == lf == l16                      # the same forward, bit for bit
    assert len(banks) == 8, banks               # w1 and w2 of 2 dense FFNs and 2 MoE layers
    for n in banks:
        to_hand = ((gf[n] - gh[n]).norm() / gh[n].norm()).item()
        to_bf16 = ((gf[n] - g16[n]).norm() / g16[n].norm()).item()
        assert to_hand <= 2 ** -6 < to_bf16, (n, "from the FP8 backward", to_hand, "from bf16's", to_bf16)
    last = "blocks.3.ffn.experts.w2"
    assert last in banks and max_rel_err(gf[last], gh[last]) <= 1e-4, max_rel_err(gf[last], gh[last])


@pytest.mark.parametrize("over, words", [
    (["parallel.precision=fp8", "parallel.tp=4", "parallel.tp_mode=2d"],
     "parallel.precision=fp8 with parallel.tp_mode=2d"),
    (["parallel.precision=fp8", "parallel.tp=2", "model.d_ff=128"],
     "model.d_ff to be a multiple of 128 x tp = 256 (got 128"),
    (["parallel.precision=fp8", "parallel.ep=2", "parallel.etp=2", "model.d_ff=128"],
     "multiple of 128 x etp = 256 (got 128"),
    (["parallel.precision=fp8", "parallel.param_dtype=bf16", "parallel.zero=1"], "parallel.param_dtype=bf16"),
    (["parallel.precision=fp8", "model.d_model=96", "model.n_heads=2"], "model.d_model to be a multiple of 128 (got 96"),
    (["parallel.precision=fp8", "model.d_ff=200"], "model.d_ff to be a multiple of 128 (got 200"),
    (["parallel.fp8_recipe=rowwise"], "parallel.fp8_recipe=rowwise needs parallel.precision=fp8"),
    (["parallel.precision=fp8", "parallel.fp8_recipe=delayed"], "parallel.fp8_recipe='delayed' is not supported"),
    (["parallel.precision=fp8", "parallel.fp8_recipe=rowwise", "parallel.tp=2"],
     "parallel.fp8_recipe=rowwise scales each row of an expert bank's input over its whole width"),
    (["parallel.precision=fp8", "parallel.fp8_recipe=rowwise", "parallel.ep=2", "parallel.etp=2"],
     "which parallel.tp=1 / parallel.etp=2 split across ranks; set fp8_recipe=tensorwise"),
    (["parallel.precision=fp8", "parallel.fp8_recipe=rowwise", "model.d_model=120", "model.n_heads=2"],
     "model.d_model to be a multiple of 16 (got 120: the rowwise FP8 GEMMs' 16-byte alignment"),
])
def test_fp8_refusals_name_the_field(over, words):
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    world = 4 if any("tp=" in o for o in over) else 1
    with pytest.raises(ValueError, match=pytest.importorskip("re").escape(words)):
        cfg = load_config(None, over)
        w = workload_from_config(cfg)
        w.validate(dataclasses.replace(cfg.parallel, dp=-1), world)


def test_fp8_linears_emulate_by_where_a_meta_model_will_run(monkeypatch):
    """train.py builds the model on meta and materialises it inside parallelize: the FP8
    Linears take torchao's kernels or its emulation by the device the model will run on
    (parallel/fp8.py target_device), not by meta."""
    import parallel.fp8 as fp8
    from models import build_model
    from models.config import ModelConfig, MoEConfig

    def meta_model():
        return build_model(ModelConfig(vocab_size=64, d_model=128, n_layers=2, n_heads=2, d_ff=256),
                           MoEConfig(num_experts=4, every=2), device="meta")

    def emulates(model):
        return {m.config.emulate for m in model.modules() if type(m).__name__ == "Float8Linear"}

    on_cpu = meta_model()
    fp8.apply_fp8(on_cpu, "tensorwise")
    assert emulates(on_cpu) == {True}
    monkeypatch.setattr(fp8, "default_device_type", lambda: "cuda")
    monkeypatch.setattr(fp8, "fp8_matmul_available", lambda device: device.type == "cuda")
    on_gpu = meta_model()
    fp8.apply_fp8(on_gpu, "tensorwise")
    assert emulates(on_gpu) == {False}
