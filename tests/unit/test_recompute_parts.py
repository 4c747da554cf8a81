"""parallel.recompute=selective's parts have one list, RECOMPUTE_PARTS
(parallel/recompute_parts.py): the plan accepts exactly its names, the runtime applies each
(parallel/recompute.py, one function a part, each changing a block that has the part) and
the planner prices what each frees (parallel/planner/memory.py FREED_ELEMS, which
recompute_saved_elems sums). tests/unit/test_selective_recompute.py measures each part's
freed bytes against the planner's, for every part of the same list."""
import pytest

from models import build_model
from models.blocks import blocks
from parallel import recompute
from parallel.plan_rules.choices import RECOMPUTE_MODULES
from parallel.planner import memory
from parallel.recompute_parts import RECOMPUTE_PARTS
from trainer.config import load_config
from trainer.planning import workload_from_config

# a model with every part: MLA, MoE blocks with a shared expert, dense blocks
EVERYTHING = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
              "model.d_ff=64", "data.seq_len=8", "moe.num_experts=4", "moe.top_k=2", "moe.every=2",
              "moe.num_shared_experts=1", "model.attention=mla", "model.kv_lora_rank=16",
              "model.q_lora_rank=24", "model.qk_rope_head_dim=4", "model.head_dim=8"]


def _snapshot(model) -> dict:
    """Each module's instance attributes by identity: a patched method or a replaced setting
    (moe_act's activation) shows as a new key or a new id."""
    return {(n, k): id(v) for n, m in model.named_modules() for k, v in vars(m).items()}


def _plan(parts):
    cfg = load_config(None, EVERYTHING + ["parallel.recompute=selective",
                                          f"parallel.recompute_modules={','.join(parts)}"])
    w = workload_from_config(cfg)
    return cfg, w, w.validate(cfg.parallel, 1)


@pytest.mark.parametrize("part", list(RECOMPUTE_PARTS))
def test_each_part_is_accepted_applied_and_priced_from_the_one_list(part, monkeypatch):
    assert list(RECOMPUTE_MODULES) == list(RECOMPUTE_PARTS)            # the names the plan accepts
    assert set(recompute._APPLY) == set(RECOMPUTE_PARTS)               # the runtime's functions
    assert set(memory.FREED_ELEMS) == set(RECOMPUTE_PARTS)             # the planner's prices
    cfg, w, plan = _plan([part])   # accepted: the plan's rules know what the part needs
    model = build_model(cfg.model, cfg.moe, device="cpu", seed=0)
    before = _snapshot(model)
    recompute.apply_recompute(blocks(model), "selective", [part])
    assert _snapshot(model) != before, f"{part} changed nothing in a model that has it"
    # the planner's freed elements are FREED_ELEMS' terms, summed: one distinct weight a part
    weight = {p: 2.0 ** i for i, p in enumerate(RECOMPUTE_PARTS)}
    monkeypatch.setattr(memory, "FREED_ELEMS", {p: (lambda b, p=p: (weight[p],)) for p in RECOMPUTE_PARTS})
    _, _, every = _plan(list(RECOMPUTE_PARTS))
    assert memory.recompute_saved_elems(w, 0, plan) == weight[part]
    assert memory.recompute_saved_elems(w, 0, every) == sum(weight.values())
