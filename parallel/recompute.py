"""Activation recomputation: trade compute in backward for memory held between forward and
backward (parallel.recompute).

full       keep only each block's input, recompute its inside during backward
           (non-reentrant torch.utils.checkpoint), ~1 extra forward.
selective  recompute only the parts named in parallel.recompute_modules (Megatron's names):
  core_attn       the attention core softmax(q k^T) v (Attention.core): keeps q, k, v, drops
                  what the kernel saves beyond them (nothing much with the fused kernels)
  layernorm       the block's two norms: their outputs are not kept by the layers that read
                  them (attention's projections, the router / FFN) but computed again from
                  the norm's input when backward needs them (output_recompute.py); under
                  autocast only fp32 readers' copies (the router's) are freed: the others
                  keep their own low-precision casts
  moe_act         the experts' activation (routed and shared, in MoE blocks): the
                  pre-activations are kept, the activation output computed again
  mlp             the dense FFN of the blocks without MoE: keeps its input only
  mla_up_proj     MLA's up-projections (LatentAttention.up): keeps the latents, drops the
                  normalised latents and the projections
  shared_experts  the shared experts of MoE blocks: keep their input only
  experts         the routed experts (ExpertBank): keep the dispatched rows only
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
from .plan import RECOMPUTE_MODULES

__all__ = ["RECOMPUTE_MODULES", "apply_recompute"]


def apply_recompute(blocks, mode: str = "full", modules=()) -> None:
    """mode "full": every block; "selective": the parts `modules` names, in every block."""
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
    ffn, attn = block.ffn, block.attn
    moe = isinstance(ffn, MoELayer)
    if "core_attn" in modules:
        _checkpointed(attn, "core")
    if "mla_up_proj" in modules and isinstance(attn, LatentAttention):
        _checkpointed(attn, "up")
    if "mlp" in modules and isinstance(ffn, DenseFFN):
        _checkpointed(ffn, "forward")
    if moe and "experts" in modules:
        _checkpointed(ffn.experts, "forward")
    if moe and "shared_experts" in modules and ffn.shared_experts is not None:
        _checkpointed(ffn.shared_experts, "forward")
    if moe and "moe_act" in modules:
        ffn.experts.set_recompute_act(True)
        if ffn.shared_experts is not None:
            ffn.shared_experts.bank.set_recompute_act(True)
    if "layernorm" in modules:
        recompute_outputs(block, (block.attn_norm, block.ffn_norm))
