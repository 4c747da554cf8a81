"""parallel.compile's choices (parallel/compile.py, trainer/config.py): auto compiles CUDA
runs of the tested layouts and nothing on a CPU, says why when it does not, and a plan
without a device compiles nothing. That the compiled runs equal eager ones is
tests/e2e/test_compile_train.py."""
import dataclasses

from parallel.compile import auto_compile, regions
from parallel.plan import ParallelPlan
from trainer.config import compile_choice, load_config, validate


def test_auto_is_on_for_cuda_runs_of_tested_layouts_only():
    plan = ParallelPlan(dp=2, ep=2, zero=3, precision="bf16")
    assert auto_compile(plan, "cuda", hf_model=False)[0] is True
    assert auto_compile(plan, "cpu", hf_model=False) == (False, "eager on cpu (parallel.compile=true compiles anyway)")
    for change, word in ((dict(pp=2), "pp=2"), (dict(tp=2), "tp=2"), (dict(cp=2), "cp=2"),
                         (dict(recompute="full"), "recompute=full"),
                         (dict(a2a_overlap="1f1b"), "a2a_overlap=1f1b"),
                         (dict(precision="fp16"), "precision=fp16")):
        on, why = auto_compile(dataclasses.replace(plan, **change), "cuda", hf_model=False)
        assert not on and word in why, (change, why)
    assert auto_compile(dataclasses.replace(plan, precision="fp8"), "cuda", hf_model=False)[0] is True
    on, why = auto_compile(plan, "cuda", hf_model=True)
    assert not on and "Hugging Face" in why


def test_plan_without_a_device_compiles_nothing():
    assert ParallelPlan().compile == "auto"
    assert ParallelPlan().validate(1).compile is False
    assert ParallelPlan(compile=True).validate(1).compile is True
    assert "compile" not in ParallelPlan().validate(1).summary()
    assert ParallelPlan(compile=True).validate(1).summary().endswith(" compile=true")


def test_trainer_resolves_auto_for_its_device():
    cfg = load_config(None, ["run.device=cpu"])
    assert compile_choice(cfg)[0] is False and validate(cfg, 1).compile is False
    cfg = load_config(None, ["run.device=cpu", "parallel.compile=true"])
    assert compile_choice(cfg) == (True, "parallel.compile=true") and validate(cfg, 1).compile is True


def test_a_block_that_routes_locally_compiles_whole():
    from models.blocks import blocks
    from trainer.planning import workload_from_config
    model = workload_from_config(load_config(None, [])).build_model()
    for b in blocks(model):
        assert regions(b) == [b]


def test_blocks_of_one_kind_share_one_graph_under_bf16():
    """Eight bf16 blocks of two kinds compile two graphs, not one per block: nothing in a
    block's forward guards on which block's parameters it holds (the bank's weight cast
    once keyed on the parameters' ids, one recompile per block, and dynamo's limit of 8
    failed the Qwen3-shaped MoE run on an H200). A counting backend: no inductor."""
    import torch
    from torch._dynamo.testing import CompileCounter

    from parallel.compile import compile_blocks
    from parallel.precision import apply_precision
    from trainer.model import build_model, init_fn
    torch._dynamo.reset()
    cfg = load_config(None, ["model.n_layers=8", "moe.every=2", "model.d_model=32",
                             "model.n_heads=2", "moe.d_ff=16", "model.d_ff=32"])
    model = build_model(cfg, torch.device("cpu"))
    init_fn(cfg, torch.device("cpu"))(model)
    apply_precision(model, "bf16")
    counter = CompileCounter()
    compile_blocks(model, backend=counter)
    tokens = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        model(tokens).float().sum().backward()
    assert counter.frame_count == 2, counter.frame_count
