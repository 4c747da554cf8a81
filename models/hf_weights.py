"""DeepSeek-V3-family checkpoints (transformers' names) <-> moekit's GPT sized by hf.config.

Shapes: D model dim, F an FFN's d_ff, E experts, H heads, R rotary width per head,
L = n_layers (the main blocks), K = model.mtp_depth.

Names (layer i < L a main block, layer L + k MTP depth k, as DeepSeek-V3's checkpoint numbers
its multi-token prediction layer after the main ones, `num_nextn_predict_layers`):
  model.embed_tokens, model.norm, lm_head          tok_emb, norm, lm_head
  model.layers.i.input_layernorm                    blocks.i.attn_norm
  model.layers.i.post_attention_layernorm           blocks.i.ffn_norm
  self_attn.q_a_proj, q_a_layernorm, q_b_proj       attn.wq_a, q_a_norm, wq_b   (q_proj: wq)
  self_attn.kv_a_proj_with_mqa, kv_a_layernorm      attn.wkv_a, kv_norm
  self_attn.kv_b_proj, o_proj                       attn.wkv_b, wo
  mlp.gate_proj, up_proj, down_proj [F,D]/[D,F]     ffn.bank.w1[0], w3[0], w2[0], transposed
  mlp.gate.weight, gate.e_score_correction_bias     ffn.router.weight, router.selection_bias
  mlp.experts.e.{gate,up,down}_proj                 ffn.experts.w1[e], w3[e], w2[e], transposed
  mlp.shared_experts.{gate,up,down}_proj            ffn.shared_experts.bank.w1[0], w3[0], w2[0]
  model.layers.(L+k).enorm, hnorm, eh_proj          mtp.k.enorm, hnorm, eh_proj
  model.layers.(L+k).shared_head.norm               mtp.k.norm
  model.layers.(L+k).<the block's names>            mtp.k.block.<the block's names>
  model.layers.(L+k).embed_tokens, shared_head.head copies of the shared embedding and head:
                                                    checked equal on the way in, written on
                                                    the way out
DeepSeek stores each rotary part interleaved (channel pairs (0, 1), (2, 3), ...; transformers'
rope_interleave); moekit rotates pairs (j, j + R/2). The way in permutes the rotary rows of
q_b_proj (q_proj) per head and of kv_a_proj_with_mqa to evens-then-odds; the way out undoes
it, so a round trip gives back every tensor byte for byte.
"""
import re

import torch

_ATTN = {"q_a_proj": "wq_a", "q_a_layernorm": "q_a_norm", "q_b_proj": "wq_b", "q_proj": "wq",
         "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b",
         "o_proj": "wo"}
_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(\w+)\.weight$")


def _rope_rows(m, name: str, n_rows: int) -> torch.Tensor | None:
    """Row indices [n_rows] putting each rotary part evens-then-odds (None: no rotary rows)."""
    R = m.qk_rope_head_dim
    half = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])
    if name in ("q_b_proj", "q_proj"):  # per head: nope rows, then the rotary ones
        per = n_rows // m.n_heads
        return torch.cat([torch.cat([torch.arange(per - R), per - R + half]) + h * per
                          for h in range(m.n_heads)])
    if name == "kv_a_proj_with_mqa":    # the latent rows, then the shared rotary key's
        return torch.cat([torch.arange(n_rows - R), n_rows - R + half])
    return None


def _block_in(m, rest: str, t: torch.Tensor, out: dict, prefix: str) -> None:
    """One checkpoint tensor of a layer (its name after model.layers.i.) into out."""
    if rest == "input_layernorm.weight":
        out[prefix + "attn_norm.weight"] = t
    elif rest == "post_attention_layernorm.weight":
        out[prefix + "ffn_norm.weight"] = t
    elif rest.startswith("self_attn."):
        name = rest.split(".")[1]
        rows = _rope_rows(m, name, t.shape[0])
        out[f"{prefix}attn.{_ATTN[name]}.weight"] = t if rows is None else t[rows]
    elif rest == "mlp.gate.weight":
        out[prefix + "ffn.router.weight"] = t
    elif rest == "mlp.gate.e_score_correction_bias":
        out[prefix + "ffn.router.selection_bias"] = t
    elif _EXPERT.match(rest):
        e, proj = _EXPERT.match(rest).groups()
        out.setdefault(f"{prefix}ffn.experts.{_PROJ[proj]}", {})[int(e)] = t.t()
    elif rest.startswith("mlp.shared_experts."):
        out[f"{prefix}ffn.shared_experts.bank.{_PROJ[rest.split('.')[2]]}"] = t.t().unsqueeze(0)
    elif rest.startswith("mlp."):
        out[f"{prefix}ffn.bank.{_PROJ[rest.split('.')[1]]}"] = t.t().unsqueeze(0)
    else:
        raise KeyError(rest)


def from_deepseek_v3(hf_state: dict, model_cfg) -> dict:
    """moekit's state dict (full tensors) of a DeepSeek-V3-family checkpoint's tensors.

    Layers past model.n_layers + model.mtp_depth - 1 are refused in one line (a checkpoint
    with more MTP layers than model.mtp_depth asks for: raise it, or the layers are lost);
    an MTP layer's copy of the embedding or head must equal the shared one."""
    m, L = model_cfg, model_cfg.n_layers
    out, copies = {}, []
    for name, t in hf_state.items():
        top = {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight": "norm.weight",
               "lm_head.weight": "lm_head.weight"}.get(name)
        if top:
            out[top] = t
            continue
        layer = _LAYER.match(name)
        if layer is None:
            raise ValueError(f"{name}: not a DeepSeek-V3 checkpoint tensor moekit knows")
        i, rest = int(layer.group(1)), layer.group(2)
        if i >= L + m.mtp_depth:
            raise ValueError(f"{name}: the checkpoint has MTP layer {i - L + 1} but "
                             f"model.mtp_depth={m.mtp_depth}; set model.mtp_depth={i - L + 1} "
                             f"to keep its weights")
        if i < L:
            _block_in(m, rest, t, out, f"blocks.{i}.")
            continue
        k = i - L
        own = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
               "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "norm.weight"}
        if rest in own:
            out[f"mtp.{k}.{own[rest]}"] = t
        elif rest in ("embed_tokens.weight", "shared_head.head.weight"):
            copies.append((name, "tok_emb.weight" if rest.startswith("embed") else "lm_head.weight", t))
        else:
            _block_in(m, rest, t, out, f"mtp.{k}.block.")
    for name, shared, t in copies:
        if not torch.equal(t, out[shared]):
            raise ValueError(f"{name} differs from the shared {shared}: moekit's MTP depths share "
                             f"the model's embedding and head (DeepSeek-V3 stores copies of them)")
    for key, experts in list(out.items()):
        if isinstance(experts, dict):
            out[key] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def to_deepseek_v3(state: dict, model_cfg) -> dict:
    """The checkpoint tensors (transformers' DeepSeek-V3 names) of moekit's state dict: the
    inverse of from_deepseek_v3, MTP layers with their copies of the embedding and head."""
    m, L = model_cfg, model_cfg.n_layers
    inv_attn = {v: k for k, v in _ATTN.items()}
    inv_proj = {v: k for k, v in _PROJ.items()}
    out = {"model.embed_tokens.weight": state["tok_emb.weight"],
           "model.norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"]}
    for name, t in state.items():
        parts = name.split(".")
        if parts[0] == "blocks":
            i, rest = int(parts[1]), parts[2:]
        elif parts[0] == "mtp":
            i = L + int(parts[1])
            own = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
            if parts[2] in own:
                out[f"model.layers.{i}.{own[parts[2]]}.weight"] = t
                continue
            out[f"model.layers.{i}.embed_tokens.weight"] = state["tok_emb.weight"]
            out[f"model.layers.{i}.shared_head.head.weight"] = state["lm_head.weight"]
            rest = parts[3:]  # after mtp.k.block
        else:
            continue
        p = f"model.layers.{i}."
        if rest[0] in ("attn_norm", "ffn_norm"):
            out[p + {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}[rest[0]]
                + ".weight"] = t
        elif rest[0] == "attn":
            hf = inv_attn[rest[1]]
            rows = _rope_rows(m, hf, t.shape[0])
            out[f"{p}self_attn.{hf}.weight"] = t if rows is None else t[torch.argsort(rows)]
        elif rest[1:] == ["router", "weight"]:
            out[p + "mlp.gate.weight"] = t
        elif rest[1:] == ["router", "selection_bias"]:
            out[p + "mlp.gate.e_score_correction_bias"] = t
        elif len(rest) < 3:
            continue  # a layer's own bookkeeping (the load counted for the bias update)
        elif rest[1] == "experts":
            for e in range(t.shape[0]):
                out[f"{p}mlp.experts.{e}.{inv_proj[rest[2]]}.weight"] = t[e].t()
        elif rest[1] == "shared_experts":
            out[f"{p}mlp.shared_experts.{inv_proj[rest[3]]}.weight"] = t[0].t()
        else:
            out[f"{p}mlp.{inv_proj[rest[2]]}.weight"] = t[0].t()
    return out


def read_deepseek_v3(path: str, model_cfg) -> dict:
    """moekit's full state dict of the DeepSeek-V3-family safetensors checkpoint in directory
    `path` (model.safetensors or its shards), read whole into host memory on each rank."""
    import glob
    import os

    from safetensors.torch import load_file
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"hf.weights={path!r} holds no *.safetensors files; point it at the "
                         f"directory of a DeepSeek-V3-family checkpoint")
    state = {}
    for f in files:
        state.update(load_file(f))
    fp8 = next((n for n in state if n.endswith("weight_scale_inv")), None)
    if fp8:
        raise ValueError(f"hf.weights={path!r} is block-quantized FP8 ({fp8}); convert it to bf16 "
                         f"first (DeepSeek's inference/fp8_cast_bf16.py)")
    return from_deepseek_v3(state, model_cfg)


def write_deepseek_v3(state: dict, model_cfg, hf_config: dict, path: str) -> None:
    """The checkpoint of moekit's state dict in DeepSeek-V3's names: model.safetensors and a
    config.json (hf_config with num_nextn_predict_layers = model.mtp_depth)."""
    import json
    import os

    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {n: t.detach().contiguous().clone() for n, t in to_deepseek_v3(state, model_cfg).items()}
    # each file whole or not at all: written beside, then renamed over
    save_file(tensors, os.path.join(path, "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(os.path.join(path, "model.safetensors.tmp"), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json.tmp"), "w") as f:
        json.dump(dict(hf_config, num_nextn_predict_layers=model_cfg.mtp_depth), f, indent=2)
    os.replace(os.path.join(path, "config.json.tmp"), os.path.join(path, "config.json"))
