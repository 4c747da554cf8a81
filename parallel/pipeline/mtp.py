"""Multi-token prediction on the last pipeline stage (models/mtp.py under parallel.pp > 1).

The depths live on the last stage with the head; they read the embedding of the tokens ahead
through the head's weight, which is the token embedding itself (model.tie_embeddings: a
tied copy whose gradient parallel/pipeline/tied.py sums with the first stage's). The stage's
forward hands out its last block's output beside the logits, and the loss function, which
alone sees the labels, runs the depths on it: the schedule back-propagates the main loss
plus mtp_loss_coef / K x the depths' losses, as one process does. Evaluation (no gradient)
scores the main loss only. Refused (parallel/plan_rules/model.py): untied embeddings, tp,
ZeRO-3 (the depths run outside the stage's forward, where FSDP2 holds the stage's own
parameters sharded), 2BW and the V schedules.
"""
import torch

from models.mtp import mtp_losses


class StageMTP:
    """The last stage's MTP: `loss` replaces the runner's loss function; `take` gives the
    depths' losses [K] averaged over the last step's micro-batches (zeros elsewhere)."""

    def __init__(self, stage, loss_fn, coef: float, depth: int):
        self.stage, self.loss_fn, self.coef, self.depth = stage, loss_fn, coef, depth
        self.terms = []  # [K] per training micro-batch, detached, in order
        stage.forward = self._forward  # instance attribute: hooks and names unchanged

    def _forward(self, h_BSD):
        h_BSD = self.stage.hidden(h_BSD)
        return self.stage.logits(h_BSD), h_BSD

    def loss(self, out, y_BS):
        logits_BSV, h_BSD = out
        main = self.loss_fn(logits_BSV, y_BS)
        if not torch.is_grad_enabled():  # evaluation: the main loss, as one process reports it
            return main
        terms_K = mtp_losses(self.stage, h_BSD, y_BS)
        self.terms.append(terms_K.detach())
        return main + self.coef / self.depth * terms_K.sum()

    def take(self, microbatches: int, device) -> torch.Tensor:
        terms = self.terms[-microbatches:]
        self.terms = []
        if not terms:
            return torch.zeros(self.depth, device=device)
        return torch.stack(terms).float().mean(dim=0)
