"""The model a config describes, built the same way by train.py and `python -m trainer.profile`."""
import models

from .config import check_hf_layout, task_arch

__all__ = ["build_model", "init_fn", "build_one_process", "task_arch"]  # task_arch lives in config.py (validation uses it)


def build_model(cfg, device):
    """Our models on the meta device (materialise with init_fn, e.g. inside parallelize), or
    a Hugging Face family with MoE FFNs when hf.family is set (built initialised on device)."""
    if cfg.hf.family:
        from models.hf_build import build_hf_model
        check_hf_layout(cfg, cfg.parallel)
        return build_hf_model(cfg.hf, cfg.model, cfg.moe, seed=cfg.train.seed, device=device)
    return models.build_model(cfg.model, cfg.moe, device="meta")


def init_fn(cfg, device):
    """Materialise and initialise a model from build_model (None: it arrives initialised).
    Init is seeded per global tensor, so every parallel layout starts from the same weights."""
    if cfg.hf.family:
        return None
    if cfg.hf.weights:  # a DeepSeek-V3-family checkpoint (models/hf_weights.py)
        from models.hf_weights import read_deepseek_v3
        return lambda m: models.init_weights(m, cfg.train.seed, device,
                                             source=read_deepseek_v3(cfg.hf.weights, cfg.model))
    return lambda m: models.init_weights(m, cfg.train.seed, device)


def build_one_process(cfg, device):
    """The model train.py would build, initialised, as a one-process Parallelized handle (the
    profiler, generation and evaluation load checkpoints into it)."""
    from parallel.apply import parallelize
    from parallel.plan import ParallelPlan
    model = build_model(cfg, device)
    init = init_fn(cfg, device)
    if init is not None:
        init(model)
    return parallelize(model, ParallelPlan().validate(1))
