"""The memory-bound term's bandwidth shares (parallel/planner/hardware.py EAGER_HBM_EFFICIENCY,
COMPILED_HBM_EFFICIENCY) stand on one measurement: bench/gpu_step.py's four train.py runs on an
H200 (docs/gpu-speed.md: tokens/s of the Qwen3-30B-A3B-shaped MoE and its dense twin, eager and
compiled, torch 2.11). The planner's prediction of each run (the h200 preset, one GPU, the
bench's own overrides) must reproduce the measured step within 5%: a change to the traced
bytes or the GEMM term that moves a prediction off its measurement fails here, and says
the shares need measuring again."""
import json

import pytest

from commands.plan import main as plan_main

# bench/gpu_step.py MOE and DENSE_TWIN, as train.py ran them there
MOE = ["model.d_model=2048", "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=4",
       "model.head_dim=128", "model.qk_norm=true", "model.activation=swiglu",
       "model.max_seq_len=2048", "model.tie_embeddings=false", "moe.num_experts=64",
       "moe.top_k=8", "moe.d_ff=768", "moe.every=1", "data.seq_len=2048",
       "train.batch_size=16", "train.micro_batch_size=8", "parallel.precision=bf16"]
TWIN = ["moe.every=0", "model.d_ff=6144"]
# docs/gpu-speed.md, one H200, 2026-11-28: tokens/s (medians of steps 3-6)
MEASURED = {("moe", False): 84_333, ("dense", False): 141_703,
            ("moe", True): 113_918, ("dense", True): 179_091}


@pytest.mark.parametrize("model,compiled", sorted(MEASURED))
def test_the_planner_reproduces_the_h200_steps(model, compiled, capsys):
    overrides = MOE + (TWIN if model == "dense" else []) + [f"parallel.compile={str(compiled).lower()}"]
    assert plan_main(["--world", "1", "--hw", "h200", "--layout", "dp1", "--json", *overrides]) == 0
    predicted = json.loads(capsys.readouterr().out)["layout"]["tokens_per_s"]
    assert predicted == pytest.approx(MEASURED[model, compiled], rel=0.05), (model, compiled)


def test_compile_auto_is_decided_as_a_cuda_run_would(capsys):
    """parallel.compile=auto: the planner plans GPU runs, so auto is what parallel/compile.py
    auto_compile decides on CUDA for the layout, not what this CPU host would (eager): the
    one-process run compiles (the compiled share), a pipeline stays eager (auto leaves pp
    untested), and each equals its explicit setting."""
    def tokens(layout, compile_):
        args = ["--world", "2", "--hw", "h200", "--layout", layout, "--json",
                *[o for o in MOE if not o.startswith("train.micro_batch_size")],
                "model.n_layers=2", "train.batch_size=4", f"parallel.compile={compile_}"]
        assert plan_main(args) == 0
        return json.loads(capsys.readouterr().out)["layout"]["tokens_per_s"]
    assert tokens("dp2", "auto") == tokens("dp2", "true") > tokens("dp2", "false")
    assert tokens("pp2", "auto") == tokens("pp2", "false") < tokens("pp2", "true")
