"""Grouped-query attention without repeated keys and values (models/layers.py Attention.core):
the flash kernel reads each kv head for its query heads, so the block neither writes the
repeated copies nor keeps them for backward. Checked against the repeated form (fp32, the
same kernel): outputs equal, gradients within 1e-5 (the group's sum in another order), and
what autograd saves for the attention is the kv heads' bytes, not the repeated ones; the
planner's attention term counts the same (models/config.py attention_saved_width)."""
import pytest
import torch
import torch.nn.functional as F

from models.config import ModelConfig
from models.layers import Attention, flash_reads_kv_groups

B, S, D, H, KV, HD = 2, 32, 64, 8, 2, 16


def _saved_bytes(fn) -> int:
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(total), out


def test_grouped_core_equals_the_repeated_and_keeps_only_kv_heads():
    torch.manual_seed(0)
    attn = Attention(D, H, n_kv_heads=KV, head_dim=HD, rope_theta=10000.0)
    x = torch.randn(B, S, D)
    q, k, v = attn.qkv(x, None, None, None, repeat=False)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    assert k.shape[1] == KV and flash_reads_kv_groups(q, None)
    grouped_bytes, y = _saved_bytes(lambda: attn.core(q, k, v, None, True))

    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    repeated_bytes, y_ref = _saved_bytes(lambda: F.scaled_dot_product_attention(
        q2, *attn.repeat_kv(k2, v2), is_causal=True))
    assert torch.equal(y, y_ref)
    gy = torch.randn_like(y)
    y.backward(gy)
    y_ref.backward(gy)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5)
    kv_heads = 2 * B * KV * S * HD * 4   # k and v, fp32
    repeated = 2 * B * H * S * HD * 4
    assert repeated_bytes - grouped_bytes == repeated - kv_heads, (repeated_bytes, grouped_bytes)


def test_a_mask_repeats_them_and_the_planner_counts_what_is_kept():
    q = torch.zeros(1, H, 4, HD)
    assert not flash_reads_kv_groups(q, torch.zeros(4, 4))  # an additive bias: repeated
    assert not flash_reads_kv_groups(q.to("meta"), None)  # another device: repeated
    gpt = ModelConfig(d_model=D, n_heads=H, n_kv_heads=KV, head_dim=HD)
    assert gpt.attention_saved_width() == (H + KV) * 2 * HD   # q, k, v heads and the output
    t5 = ModelConfig(arch="switch", d_model=D, n_heads=H, n_kv_heads=KV, head_dim=HD)
    assert t5.attention_saved_width() == 2 * H * 2 * HD


@pytest.mark.parametrize("dtype, head_dim, want", [(torch.bfloat16, 128, True), (torch.float16, 256, True),
                                                   (torch.float32, 128, False), (torch.bfloat16, 512, False)])
def test_cuda_rule(monkeypatch, dtype, head_dim, want):
    """On CUDA the rule follows the flash kernel's limits (checked here on a stand-in whose
    device says cuda: no GPU on this machine)."""
    class OnCuda:
        device = torch.device("cuda")

        def __init__(self):
            self.dtype, self.shape = dtype, (1, H, 4, head_dim)
    assert flash_reads_kv_groups(OnCuda(), None) is want
