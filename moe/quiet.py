"""torchao's import, quiet where its CUDA kernels cannot load.

transformers imports torchao (when installed) as soon as it builds any model, to see whether
a checkpoint is torchao-quantized. On a machine without CUDA, torchao's import logs a line for
each kernel library it cannot load and torch logs one for each Enum torchao registers with
its pytree: four lines on every Hugging Face path, none of which matters there (or to FP8's
emulation). Where CUDA is present they stay: there a library that does not load matters.
"""
import contextlib
import importlib.util
import logging
import sys

import torch

_NOISY = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_torchao_import(quiet: bool = True):
    """While it is open, torchao's and torch's pytree loggers say errors only (quiet=False:
    nothing changes)."""
    loggers = [logging.getLogger(n) for n in _NOISY]
    levels = [lg.level for lg in loggers]
    if quiet:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def transformers_quietly():
    """The transformers module, with torchao imported first (if installed and not imported
    yet) under quiet_torchao_import on a machine without CUDA."""
    if "torchao" not in sys.modules and importlib.util.find_spec("torchao") is not None:
        with quiet_torchao_import(not torch.cuda.is_available()):
            import torchao  # noqa: F401 -- so transformers' own imports find it loaded
            try:  # what transformers' torchao quantizer imports when it is loaded
                import torchao.prototype.safetensors.safetensors_support  # noqa: F401
            except ImportError:
                pass
    import transformers
    return transformers
