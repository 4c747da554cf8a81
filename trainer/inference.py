"""A trained run, loaded for inference in one process: what `python -m trainer.generate` and
`python -m trainer.evaluate` start from.

`load_run(run_dir, step, overrides)` reads the run's resolved config (RUN_DIR/config.toml,
written by train.py), builds the model exactly as train.py does (trainer/model.py) as one
process, loads the model weights of the newest good checkpoint (or step N) whatever layout
wrote it (DCP reshards: trainer/checkpoint.load_model_weights), and turns every MoE layer
dropless in eval mode (no token is dropped at inference, whatever capacity training used).
The parallel section of the run is ignored: inference runs on one device (run.device).
"""
from dataclasses import dataclass
from pathlib import Path

from moe.aux import moe_layers

from .config import ConfigError, check_sections, load_config, to_dict
from .model import build_one_process, task_arch


@dataclass
class LoadedRun:
    cfg: object          # the run's Config (parallel section reset to one process)
    model: object        # the one-process model, eval mode, weights loaded
    arch: str            # 'gpt' (decoder-only) or 'switch' (encoder-decoder)
    checkpoint: Path     # the checkpoint loaded
    step: int
    saved_world: int     # world size of the run that wrote it
    device: object
    trained_ep: int = 1  # the run's parallel.ep (the load profiler plans its rows per rank)

    def describe(self) -> str:
        routed = self.cfg.moe.capacity_factor
        cap = "as trained" if routed is None else f"trained with capacity_factor={routed:g}"
        return (f"checkpoint {self.checkpoint} (step {self.step}, written by {self.saved_world} "
                f"rank(s)); one process on {self.device}; MoE routing at inference: dropless "
                f"({cap})")


def load_run(run_dir, step=None, overrides=()) -> LoadedRun:
    from parallel.plan import ParallelPlan

    from . import checkpoint
    from .distributed import choose_device
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"{run_dir} is not a train.py run directory (no config.toml); pass the "
                          f"run.dir a training run printed")
    ckpt = _checkpoint(run_dir, step)
    cfg = load_config(run_dir / "config.toml", overrides)
    trained_ep = cfg.parallel.ep if isinstance(cfg.parallel.ep, int) else 1
    cfg.parallel = ParallelPlan()  # one process: the run's layout does not matter here
    check_sections(cfg)
    if cfg.moe.router == "expert_choice" and cfg.moe.every:
        raise ConfigError("moe.router='expert_choice' chooses tokens per expert over a whole "
                          "sequence, which no causal decoding or dropless inference can follow; "
                          "inference needs a token-choice model")
    saved = checkpoint.read_trainer_state(ckpt).get("config", {})
    diffs = checkpoint.structural_diff(saved, to_dict(cfg)) if saved else []
    if diffs:  # the checkpoint's tensors have the run's shapes
        raise ConfigError(f"{'; '.join(diffs)}: the checkpoint {ckpt} was trained with the first "
                          f"value and these fields set tensor shapes; drop the override")
    device = choose_device(cfg.run.device, 0)
    cfg.hf.weights = ""  # the checkpoint brings the weights (not the run's starting ones)
    par = build_one_process(cfg, device)
    checkpoint.load_model_weights(ckpt, par)
    model = par.model.eval()
    for _, layer in moe_layers(model):
        layer.set_dropless_eval()
    info = checkpoint.read_trainer_state(ckpt)
    return LoadedRun(cfg, model, task_arch(cfg), ckpt, int(info["step"]),
                     int(info.get("world_size", 1)), device, trained_ep)


def _checkpoint(run_dir: Path, step):
    """The newest good checkpoint of the run, or the one of step N."""
    from . import checkpoint
    done = checkpoint.list_complete(run_dir)
    if step is None:
        found = checkpoint.newest_good(run_dir, say=lambda line: print(f"note: {line}"), move=False) \
            if done else None
        if found is None:
            raise ConfigError(f"{run_dir} holds no complete checkpoint yet; train with "
                              f"checkpoint.every > 0 (or until the run ends) first")
        return found
    path = checkpoint.step_dir(run_dir, step)
    problem = checkpoint.verify(path) if path.is_dir() else "no such checkpoint"
    if problem:
        have = ", ".join(str(s) for s, _ in done) or "none"
        raise ConfigError(f"--step {step}: {problem} in {run_dir}; complete checkpoints: {have}")
    return path


def run_tokenizer(cfg):
    """The tokenizer the run's data was prepared with (byte: nothing to read)."""
    from data.tokenizer import ByteTokenizer, load_tokenizer
    if cfg.data.tokenizer == "byte":
        return ByteTokenizer()
    from data.prepare import prepared_dir
    try:
        return load_tokenizer(prepared_dir(cfg.data))
    except (OSError, ValueError) as e:
        raise ConfigError(f"the run's BPE tokenizer could not be read ({e}); its prepared data "
                          f"(data.source={cfg.data.source!r}, data.cache_dir="
                          f"{cfg.data.cache_dir!r}) must be where training left it") from None
