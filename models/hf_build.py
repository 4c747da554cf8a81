"""The `[hf]` config section (HFConfig) and its checks. Building the model it describes is
Hugging Face interop: moe/hf/build.py (build_hf_model, re-exported here, where train.py and
the README have always found it).
"""
import os
from dataclasses import dataclass

from moe.hf.build import (DENSE_TASKS, MOE_TASKS, TASKS, HFLanguageModel, HFSeq2Seq,
                          build_hf_model, hf_config, pretrained_vocab_size)

from .config import help_field



__all__ = ["HFConfig", "moe_section_conflicts", "DENSE_TASKS", "MOE_TASKS", "TASKS", "HFLanguageModel",
           "HFSeq2Seq", "build_hf_model", "hf_config", "pretrained_vocab_size"]

_f = help_field


@dataclass
class HFConfig:
    family: str = _f("", "train a Hugging Face model of this family instead of model.arch: "
                         "gpt2 | llama | mistral | qwen2 | t5 (MoE FFNs swapped in), or adopt an "
                         "MoE model from hf.pretrained: " + " | ".join(MOE_TASKS) + "; '' = off")
    pretrained: str = _f("", "local directory written by save_pretrained to start from (its "
                             "sizes win over model.*); '' = fresh init sized by model.*")
    upcycle: bool = _f(True, "with hf.pretrained: experts start as copies of the dense FFN")
    kv_heads: int = _f(0, "llama/mistral/qwen2 key-value heads (grouped-query attention); "
                          "0 = model.n_heads")
    config: str = _f("", "a transformers config.json (file or directory; nothing downloaded) "
                         "whose architecture sizes moekit's own GPT: llama | mistral | qwen3 | "
                         "mixtral | qwen3_moe | deepseek_v3; [model]/[moe] values set in the TOML "
                         "or on the command line win; '' = off")
    weights: str = _f("", "with a deepseek_v3 hf.config: a directory of that checkpoint's "
                          "safetensors (bf16/fp32, transformers' names) to start moekit's GPT "
                          "from, its MTP layers into model.mtp_depth's depths "
                          "(models/hf_weights.py); '' = fresh init")

    def validate(self) -> "HFConfig":
        if self.family not in ("",) + tuple(TASKS):
            hint = (" (bert is supported by moe.moefy, but train.py has no masked-LM task)"
                    if self.family == "bert" else "")
            raise ValueError(f"hf.family={self.family!r} is not trainable here; use one of "
                             f"{sorted(TASKS)} or '' for model.arch{hint}")
        if self.pretrained and not os.path.isfile(os.path.join(self.pretrained, "config.json")):
            raise ValueError(f"hf.pretrained={self.pretrained!r} has no config.json; point it at "
                             f"a directory written by save_pretrained (nothing is downloaded)")
        if self.config and (self.family or self.pretrained):
            raise ValueError(f"hf.config={self.config!r} sizes moekit's own GPT; it cannot be "
                             f"combined with hf.family/hf.pretrained (a transformers model); "
                             f"remove one of them")
        if self.weights and not self.config:
            raise ValueError(f"hf.weights={self.weights!r} needs hf.config (the checkpoint's "
                             f"config.json, model_type deepseek_v3) to size the model")
        if self.weights and not os.path.isdir(self.weights):
            raise ValueError(f"hf.weights={self.weights!r} is not a directory; point it at the "
                             f"directory holding the checkpoint's *.safetensors")
        if self.kv_heads < 0:
            raise ValueError(f"hf.kv_heads={self.kv_heads} must be >= 0")
        if self.family in MOE_TASKS and not self.pretrained:
            raise ValueError(f"hf.family={self.family!r} is adopted from a checkpoint: set "
                             f"hf.pretrained to a local save_pretrained directory of that model")
        return self


def moe_section_conflicts(moe_cfg, model_cfg) -> list:
    """[moe] fields set away from their defaults (both validated): an adopted MoE model takes
    its routing from its checkpoint, so a run that sets them is refused rather than silently
    trained with other routing."""
    import dataclasses
    default = type(moe_cfg)()
    default.validate(model_cfg)
    return [f.name for f in dataclasses.fields(moe_cfg)
            if f.name != "router_replay" and getattr(moe_cfg, f.name) != getattr(default, f.name)]
