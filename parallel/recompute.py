"""Activation recomputation: trade compute in backward for memory held between forward and
backward (parallel.recompute).

full       keep only each block's input, recompute its inside during backward
           (non-reentrant torch.utils.checkpoint), ~1 extra forward.
selective  recompute only the parts named in parallel.recompute_modules: RECOMPUTE_PARTS
           (parallel/recompute_parts.py) says what each recomputes and frees; _APPLY below
           holds one function a part.
Each is applied by patching the module instance's method (parameter names and hooks are
unchanged); a checkpointed part holds no collective, so nothing is communicated again. The
MoE layers' routing is outside every part but `full`'s; under `full` it is deterministic
(jitter off, or the RNG state restored by checkpoint), so the recomputed routing is the
forward's.
"""
import functools

from torch.utils.checkpoint import checkpoint

from models.layers import LatentAttention
from moe import DenseFFN, MoELayer

from .output_recompute import recompute_outputs
from .recompute_parts import RECOMPUTE_PARTS

__all__ = ["RECOMPUTE_PARTS", "apply_recompute"]


def apply_recompute(blocks, mode: str = "full", modules=()) -> None:
    """mode "full": every block; "selective": the parts `modules` names, in every block."""
    unknown = sorted(set(modules) - set(_APPLY)) if mode != "full" else []
    if unknown:
        raise ValueError(f"recompute_modules names {', '.join(unknown)}; use any of "
                         f"{', '.join(_APPLY)}")
    for block in blocks:
        if mode == "full":
            _checkpointed(block, "forward")
        else:
            _selective(block, set(modules))


def _checkpointed(module, method: str) -> None:
    inner = getattr(module, method)

    @functools.wraps(inner)
    def run(*args, _inner=inner, **kwargs):
        return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

    setattr(module, method, run)


def _selective(block, modules: set) -> None:
    for part, apply in _APPLY.items():
        if part in modules:
            apply(block)


def _is_moe(block) -> bool:
    return isinstance(block.ffn, MoELayer)


def _core_attn(block) -> None:
    _checkpointed(block.attn, "core")


def _mla_up_proj(block) -> None:
    if isinstance(block.attn, LatentAttention):
        _checkpointed(block.attn, "up")


def _mlp(block) -> None:
    if isinstance(block.ffn, DenseFFN):
        _checkpointed(block.ffn, "forward")


def _experts(block) -> None:
    if _is_moe(block):
        _checkpointed(block.ffn.experts, "forward")


def _shared_experts(block) -> None:
    if _is_moe(block) and block.ffn.shared_experts is not None:
        _checkpointed(block.ffn.shared_experts, "forward")


def _moe_act(block) -> None:
    if _is_moe(block):
        block.ffn.experts.set_recompute_act(True)
        if block.ffn.shared_experts is not None:
            block.ffn.shared_experts.bank.set_recompute_act(True)


def _layernorm(block) -> None:
    recompute_outputs(block, (block.attn_norm, block.ffn_norm))


# one function a part of RECOMPUTE_PARTS (the same keys: tests/unit/test_recompute_parts.py),
# in the order they patch a block: layernorm's output recompute wraps the block's forward last
_APPLY = {"core_attn": _core_attn, "mla_up_proj": _mla_up_proj, "mlp": _mlp, "experts": _experts,
          "shared_experts": _shared_experts, "moe_act": _moe_act, "layernorm": _layernorm}
