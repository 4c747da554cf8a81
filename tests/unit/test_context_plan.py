"""parallel.cp in the plan: degrees, the rank layout (cp ranks inside the dp replicas, the
pool and expert folding), and every refusal naming the field and the fix."""
import pytest

from models.config import ModelConfig, MoEConfig
from parallel.mesh import rank_groups
from parallel.plan import ParallelPlan

M = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, d_ff=64, max_seq_len=64)
MOE = MoEConfig(num_experts=4, top_k=2, every=2)


def test_cp_ranks_are_replicas_and_fold_into_experts():
    p = ParallelPlan(cp=2, ep=2).validate(2, M, MOE, 8, 32)
    assert (p.dp, p.replicas, p.pool, p.edp, p.world) == (1, 2, 2, 1, 2)
    g = rank_groups(ParallelPlan(dp=2, cp=2, tp=2, ep=4).validate(8, M, MOE, 8, 32))
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]       # rank = (dp*cp + c)*tp + t
    assert g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]          # gradient replicas: dp x cp
    assert g["pool"] == [list(range(8))] and g["ep"][0] == [0, 1, 2, 3]
    assert "cp=2 cp_mode=ring" in p.summary()


@pytest.mark.parametrize("kw,world,model_kw,moe_kw,seq,pattern", [
    (dict(cp=2, tp=4, tp_mode="2d"), 8, {}, {}, 32, r"parallel.cp=2 with parallel.tp_mode=2d"),
    (dict(cp=2, pp=2, pp_schedule="zbv"), 4, {}, {}, 32, r"pp_schedule=zbv.*1F1B family"),
    (dict(cp=2, pp=2, pp_schedule="2bw"), 4, {"tie_embeddings": False}, {}, 32, r"pp_schedule=2bw"),
    (dict(cp=2, ps_servers=1), 2, {}, {}, 32, r"ps_servers"),
    (dict(cp=2, zero=3, offload="optimizer"), 2, {}, {}, 32, r"offload=optimizer"),
    (dict(cp=2, precision="fp16"), 2, {}, {}, 32, r"precision='fp16'"),
    (dict(cp=2, compile=True), 2, {}, {}, 32, r"compile=true"),
    (dict(cp=2), 2, {"arch": "switch"}, {}, 32, r"model.arch='gpt' only"),
    (dict(cp=4, cp_mode="ulysses"), 4, {"n_heads": 2}, {}, 32, r"heads per tp rank.*divisible by parallel.cp=4"),
    (dict(cp=2), 2, {"dropout": 0.1}, {}, 32, r"cp_mode=ring with model.dropout=0.1"),
    (dict(cp=2), 2, {}, {"capacity_factor": 1.25}, 32, r"moe.capacity_factor=1.25 with parallel.cp=2"),
    (dict(cp=2), 2, {}, {"router": "expert_choice", "capacity_factor": None}, 32, r"moe.router=expert_choice"),
    (dict(cp=2, tp=2), 4, {}, {}, 36, r"data.seq_len=36 is not divisible by 2 x parallel.cp x parallel.tp = 8"),
    (dict(cp=3), 2, {}, {}, 36, r"parallel.dp\*tp\*pp\*cp|tp\*pp\*cp = 1\*1\*3 = 3 does not divide"),
    (dict(cp=0), 2, {}, {}, 32, r"parallel.cp=0 must be an integer >= 1"),
    (dict(cp=2, cp_mode="bogus"), 2, {}, {}, 32, r"parallel.cp_mode='bogus' is not supported"),
])
def test_cp_refusals(kw, world, model_kw, moe_kw, seq, pattern):
    m = ModelConfig(**{**M.__dict__, **model_kw})
    moe = MoEConfig(**{**MOE.__dict__, **moe_kw})
    with pytest.raises(ValueError, match=pattern):
        ParallelPlan(**kw).validate(world, m, moe, 8, seq)
