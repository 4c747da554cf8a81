"""Former home of `moe.hf_build.build_hf_model(hf_cfg, model_cfg, moe_cfg, seed, device)`, as
an earlier README documented it. The code lives in moe/hf/build.py (the `[hf]` config section
in models/hf_build.py); this alias keeps scripts written from that README working."""
from .hf.build import build_hf_model, hf_config, pretrained_vocab_size

__all__ = ["build_hf_model", "hf_config", "pretrained_vocab_size"]
