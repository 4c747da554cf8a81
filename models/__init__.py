"""Single-device reference models: GPT-style MoE decoder and Switch-style encoder-decoder.

Interface (trainer and parallel/ rely on it):
    build_model(model_cfg, moe_cfg, device="meta") -> nn.Module
    init_weights(model, seed, device)               -> materialise + deterministic init
    count_params(model)                             -> {"total", "active_per_token"}
    moe_layers(model)                               -> [(name, MoELayer)]
    blocks(model)                                   -> the transformer blocks, every stack
"""
from .blocks import block_stacks, blocks
from .build import build_model, count_params, init_weights, moe_layers
from .config import ModelConfig, MoEConfig, field_help, parse_capacity_factor

__all__ = ["ModelConfig", "MoEConfig", "build_model", "init_weights", "count_params",
           "moe_layers", "blocks", "block_stacks", "field_help", "parse_capacity_factor"]
