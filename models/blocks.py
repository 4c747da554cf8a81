"""The one answer to "which modules are the transformer blocks" of a model.

Precision (autocast), recomputation, compile, FSDP2 units, the 2-D grid and the pipeline
split all ask `blocks(model)`; a second, local answer is how a Switch model once trained its
blocks in fp32 under parallel.precision=bf16 (precision looked at model.blocks only).
"""
import torch.nn as nn


def block_stacks(model: nn.Module) -> list:
    """The ModuleLists of blocks, in forward order: [model.blocks] (GPT) or
    [encoder.blocks, decoder.blocks] (the encoder-decoder); [] for a model without them
    (a Hugging Face model, whose layers its own code runs)."""
    out = []
    for owner in (model, getattr(model, "encoder", None), getattr(model, "decoder", None)):
        stack = getattr(owner, "blocks", None) if owner is not None else None
        if isinstance(stack, nn.ModuleList):
            out.append(stack)
    return out


def blocks(model: nn.Module) -> list:
    """Every transformer block of the model, in forward order (see block_stacks), then the
    multi-token prediction depths' blocks (models/mtp.py): precision, recomputation, compile,
    FSDP2 units and tensor/context parallelism treat them as the model's own."""
    return [b for stack in block_stacks(model) for b in stack] + mtp_blocks(model)


def mtp_blocks(model: nn.Module) -> list:
    """The blocks of the model's MTP depths, [] without them."""
    mtp = getattr(model, "mtp", None)
    return [d.block for d in mtp] if isinstance(mtp, nn.ModuleList) else []
