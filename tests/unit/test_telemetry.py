"""Per-step TFLOP/s and MFU (trainer/telemetry.py): the FLOPs of the default model equal a
hand count, and the peak behind mfu comes from log.peak_tflops or a known GPU, else none."""
import torch

from trainer.config import load_config
from trainer.model import build_model
from trainer.telemetry import device_peak_tflops, peak_for_name, step_flops


def test_default_model_flops_equal_a_hand_count():
    cfg = load_config(None, [])
    m, moe = cfg.model, cfg.moe
    D, F, V, L, H, S = m.d_model, m.d_ff, m.vocab_size, m.n_layers, m.n_heads, cfg.data.seq_len
    assert (D, F, V, L, H, S, moe.num_experts, moe.top_k, moe.every) == (128, 512, 256, 4, 4, 128, 8, 2, 2)
    assert m.activation == "gelu" and m.tie_embeddings   # ungated FFNs; the head is a matmul
    dense_blocks, moe_blocks = 2, 2                        # blocks 1 and 3 are MoE (every 2)
    matmul = (L * 4 * D * D                                # q, k, v, o
              + dense_blocks * 2 * D * F                   # w1, w2
              + moe_blocks * (moe.top_k * 2 * D * F + D * moe.num_experts)  # K experts + router
              + V * D)                                     # the (tied) output head
    attention = L * 2 * S * H * (2 * (D // H)) // 2        # QK^T and AV over S keys, causal:
    #                                                        half (Megatron's convention)
    per_token = 2 * matmul + attention
    model = build_model(cfg, torch.device("meta"))
    assert step_flops(cfg, model) == 3 * per_token * cfg.train.batch_size * S
    assert step_flops(cfg, model) == 14_118_027_264


def test_the_peak_behind_mfu():
    assert device_peak_tflops(0.0, torch.device("cpu")) is None      # no mfu, not an invented one
    assert device_peak_tflops(123.0, torch.device("cpu")) == 123.0
    assert peak_for_name("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_for_name("NVIDIA H200") == 989.0
    assert peak_for_name("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_for_name("AMD Instinct MI300X") == 1307.0
    assert peak_for_name("NVIDIA GeForce RTX 4090") is None


def test_plan_check_runs_where_asked_or_where_a_preset_models_the_step():
    from trainer.plan_check import enabled
    from trainer.telemetry import preset_for_name
    assert preset_for_name("NVIDIA H100 80GB HBM3") == "h100"
    assert preset_for_name("NVIDIA GeForce RTX 4090") is None
    cpu = torch.device("cpu")
    assert not enabled("auto", cpu)   # no step-time model for a CPU: off unless asked
    assert enabled("on", cpu) and not enabled("off", cpu)
