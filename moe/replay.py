"""Router replay across a whole model: record the experts every MoE layer chose, and make a
later forward use exactly those experts.

Shapes: B sequences, S positions, K experts per token, L MoE layers (in module order).

Reinforcement-learning fine-tuning samples rollouts with one forward (generation, KV-cached)
and trains on them with another; when the two route a token to different experts, the policy
gradient is taken through a model that did not produce the sample. Recording the rollout's
choices and replaying them in training removes that mismatch.

`RoutingRecorder(model)` watches each layer's router (a forward hook reading the Routing it
returns, as the load profiler does: the layer's contract is untouched) and appends the chosen
ids of every call, so a KV-cached decode (the prompt, then one token per step) adds up to
ids [B, S, K] per layer for the S positions fed. `replaying(model, ids_BLSK)` passes layer l
its slice ids[:, l] through MoELayer's own replay argument (forward(x, expert_ids=)); keep the
backward inside it when activations are recomputed, so the recomputed forward replays too.
What replay means for the gates, capacity and balance losses: moe/router.py Router.forward.
"""
import contextlib

import torch

from .aux import moe_layers


class RoutingRecorder:
    """Context manager: ids() -> long [B, L, S, K], every layer's choices over the calls made
    inside it, concatenated along the positions."""

    def __init__(self, model, layers=None):
        """layers: [(name, MoELayer)] to record (default: all of the model's; a caller whose
        forward runs only some, e.g. a GPT's main blocks without its MTP depths, names them)."""
        self.layers = moe_layers(model) if layers is None else list(layers)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no MoELayer: nothing to record")
        for name, layer in self.layers:
            if layer.router.config.kind != "token_choice":
                raise ValueError(f"{name}: recording routing needs token-choice routing "
                                 f"(expert choice picks tokens per expert)")
        self.chunks = [[] for _ in self.layers]
        self._hooks = []

    def __enter__(self):
        self._hooks = [layer.router.register_forward_hook(
            lambda mod, args, routing, i=i: self.chunks[i].append(routing.ids_GSK.detach()))
            for i, (_, layer) in enumerate(self.layers)]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return False

    def ids(self) -> torch.Tensor:
        """[B, L, S, K]: the chosen experts of every position fed, per layer."""
        if not self.chunks[0]:
            raise ValueError("no forward ran inside the recorder")
        per_layer = [torch.cat(chunks, dim=1) for chunks in self.chunks]  # each [B, S, K]
        return torch.stack(per_layer, dim=1)


@contextlib.contextmanager
def replaying(model, ids_BLSK):
    """Inside: MoE layer l of `model` routes its input [B, S, D] to ids_BLSK[:, l] (None:
    no replay, a no-op)."""
    if ids_BLSK is None:
        yield
        return
    layers = moe_layers(model)
    if ids_BLSK.shape[1] != len(layers):
        raise ValueError(f"router replay: the ids hold {ids_BLSK.shape[1]} MoE layers, the model "
                         f"has {len(layers)}")

    def hook(l):
        return lambda mod, args, kwargs: (args, {**kwargs, "expert_ids": ids_BLSK[:, l]})
    handles = [layer.register_forward_pre_hook(hook(l), with_kwargs=True)
               for l, (_, layer) in enumerate(layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
