"""The attention of real models (hf.config) under the layouts: grouped-query attention with
an explicit head width and qk_norm (Qwen3), and multi-head latent attention (DeepSeek-V3),
each against one process with the same weights and global batch (tiny GPT, fp32):
  outputs   the logits of this rank's rows (and sequence part)   within 2e-6 absolute
  gradients every parameter after one backward and the layout's  within 1e-6 absolute +
            gradient sync                                          1e-4 relative
  training  5 AdamW steps with global-norm clipping, in fp64:    1e-6 relative
            loss and grad norm per step (pipeline layouts: this check only)
In fp32 the training check cannot be tight on every CPU (tests/tolerance.py, rule 5): Adam
turns a gradient element near zero into a step of +-lr whose sign the kernels' rounding
decides, so two correct runs drift apart (gqa_qknorm_tp2 on a Xeon with AMX: the grad norm
4.6e-6 apart at step 1, 1.6e-4 at step 4, past the 1e-4 this test once read off another
machine). In fp64 the same amplification of fp64 rounding stays below 1e-10 (measured: loss
4e-11 at step 4 under tp2); what is left are the few sums the layouts keep in fp32 whatever
the parameters: the pipeline reports its loss as an fp32 sum (one fp32 rounding of a loss
near 4: 1.1e-7 relative, measured 1.0e-7) and ring attention merges its softmax statistics
in fp32 (measured 5.7e-9 on the norm): 1e-6, a few fp32 roundings with margin, still 100x
below the fp32 drift above.
The qk_norm weights under tp are the case to watch: each tp rank normalises its own heads,
so their gradient is the sum over tp (a missing sum fails the gradient check by ~2x); under
MLA the shared rotary key and the replicated down-projections are (parallel/tensor/one_d.py).
"""
import pytest
import torch

from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
OUT_ATOL, GRAD_ATOL, GRAD_RTOL, ATOL, RTOL = 2e-6, 1e-6, 1e-4, 0.0, 1e-6
TRAIN = torch.float64  # the training steps' parameters (module docstring)

GQA = {"n_kv_heads": 2, "head_dim": 16, "qk_norm": True}           # q width 64 != d_model 32
MLA = {"attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
       "head_dim": 8, "v_head_dim": 12}

W2 = [("gqa_qknorm_tp2", dict(tp=2), {"model": GQA}),
      ("mla_tp2", dict(tp=2), {"model": MLA}),
      ("gqa_qknorm_cp2_ulysses", dict(cp=2, cp_mode="ulysses"), {"model": GQA}),
      ("mla_cp2_ring_ep2", dict(cp=2, ep=2), {"model": MLA})]
W4 = [("gqa_qknorm_tp2_dp2_ep2_zero1", dict(tp=2, dp=2, ep=2, zero=1), {"model": GQA}),
      ("mla_tp2_dp2_ep2", dict(tp=2, dp=2, ep=2), {"model": MLA}),
      ("mla_cp2_ulysses_dp2_zero2", dict(cp=2, cp_mode="ulysses", dp=2, zero=2), {"model": MLA}),
      # DeepSeek-V3's shape: dense first blocks, a pipeline stage without experts under ep
      ("mla_pp2_dp2_ep2_dense_first", dict(pp=2, dp=2, ep=2, microbatches=2),
       {"model": MLA, "tie": False, "moe": {"first_moe_layer": 2, "every": 1}})]


def _configs(variant):
    variant = dict(variant)
    model_fields, moe_fields = variant.pop("model", {}), variant.pop("moe", {})
    model_cfg, moe_cfg = dc.configs(**variant)
    for k, v in model_fields.items():
        setattr(model_cfg, k, v)
    for k, v in moe_fields.items():
        setattr(moe_cfg, k, v)
    model_cfg.validate()
    moe_cfg.validate(model_cfg)
    return model_cfg, moe_cfg


def _worker(rank, world, layouts):
    out = {}
    for name, spec, variant in layouts:
        if spec.get("pp", 1) > 1:
            out[name] = ((0.0, []), dc.train_layout(world, spec, *_configs(variant), dtype=TRAIN))
        else:
            (diff, grads, _comm), losses = dc.check_layouts(world, [(name, spec, variant)], _configs,
                                                            GRAD_ATOL, GRAD_RTOL, TRAIN)[name]
            out[name] = ((diff, grads), losses)
    return out


def _check(world, layouts, timeout):
    refs = {name: dc.reference_run(*_configs(v), dtype=TRAIN) for name, _, v in layouts}
    results = run_distributed(_worker, world, layouts, timeout=timeout)
    for name, _spec, _v in layouts:
        for rank, rank_out in enumerate(results):
            (out_diff, grads), losses = rank_out[name]
            assert len(refs[name]) == dc.STEPS
            dc.assert_same_as_one_process(name, rank, out_diff, grads, losses, refs[name],
                                          OUT_ATOL, ATOL, RTOL)


def test_real_attention_equals_one_process_world2():
    _check(2, W2, 300)


@pytest.mark.long
def test_real_attention_equals_one_process_world4():
    _check(4, W4, 400)
