"""Activation recomputation per block: keep only each block's input, recompute its inside
during backward (non-reentrant torch.utils.checkpoint), trading ~1 extra forward for memory.

Applied by patching the block instance's forward, so parameter names and hooks are unchanged.
The MoE layers run twice per step; their routing is deterministic (jitter off, or seeded RNG
state restored by checkpoint), so the recomputed routing is the one of the forward.
"""
import functools

from torch.utils.checkpoint import checkpoint


def apply_recompute(blocks) -> None:
    for block in blocks:
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
