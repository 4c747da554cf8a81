"""Tied embeddings across pipeline stages (Megatron's scheme): the first stage holds the
token embedding, the last the output head, both the same [V, D] matrix. TiedEmbedding makes
them start identical (a broadcast from the first stage after init), sums their gradients
over the two holders before the optimizer step, counts the norm once, and names the weight
once in checkpoints (parallel/state_dict.py applies that rename)."""
import torch
import torch.distributed as dist

from ..dtensors import local


class TiedEmbedding:
    """The token-embedding weight that the output head shares (model.tie_embeddings).

    `group` holds the first and the last pipeline rank with the same (dp, tp) coordinates
    (None without pipeline parallelism: one module pair on one rank, nothing to sync).
    """
    CANONICAL, ALIAS = "tok_emb.weight", "lm_head.weight"

    def __init__(self, model, group=None):
        self.model, self.group = model, group
        self.first, self.last = model.tok_emb is not None, model.lm_head is not None

    @property
    def param(self):  # looked up each time: FSDP2 replaces parameter objects
        return self.model.tok_emb.weight if self.first else self.model.lm_head.weight

    def broadcast_from_first(self) -> None:
        """Collective over the group: the last stage's copy := the first stage's (after init)."""
        if self.group is not None:
            src = dist.get_global_rank(self.group, 0)
            with torch.no_grad():
                dist.broadcast(local(self.param).data, src=src, group=self.group)

    def sum_grads(self, grad) -> None:
        """Collective over the group: both holders get the sum of their gradients (in
        whatever form this rank holds it: full, ZeRO-2 slice or FSDP2 shard, the same on both)."""
        if self.group is not None:
            dist.all_reduce(local(grad), group=self.group)

    def counted_elsewhere(self) -> frozenset:
        """The last stage's copy is not counted in the gradient norm (the first stage's is)."""
        return frozenset({id(self.param)}) if self.last and not self.first else frozenset()


def is_tied(model) -> bool:
    """True when the model's output head uses its token-embedding matrix."""
    emb, head = getattr(model, "tok_emb", None), getattr(model, "lm_head", None)
    return emb is not None and head is not None and head.weight is emb.weight
