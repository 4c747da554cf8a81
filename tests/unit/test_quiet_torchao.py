"""moe/quiet.py: building a Hugging Face model through moekit prints none of torchao's
import noise on a machine without CUDA (issue 62), while a plain import still does here
(so the check can fail)."""
import subprocess
import sys

import pytest
import torch

BUILD = ("tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, "
         "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))")
NOISE = ("Failed to load", "_pytree")


def _stderr(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300).stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the noise is a CPU build's (CUDA kernels not loadable)")
def test_hf_models_built_through_moekit_print_no_torchao_noise():
    pytest.importorskip("torchao")
    plain = _stderr(f"import transformers as tf; {BUILD}")
    if not any(n in plain for n in NOISE):
        pytest.skip("this torchao imports quietly by itself")
    quiet = _stderr(f"from moe.quiet import transformers_quietly; tf = transformers_quietly(); {BUILD}")
    assert not any(n in quiet for n in NOISE), quiet
