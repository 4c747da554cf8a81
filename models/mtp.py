"""Multi-token prediction (DeepSeek-V3, section 2.2): depth k predicts the token k+1 ahead.

Shapes: B batch, S sequence (this rank's part under context parallelism), D model dim,
V vocabulary, K depths (model.mtp_depth).

Depth k = 1..K keeps the causal chain: at position i it reads the previous depth's hidden
state h^{k-1}_i (h^0: the output of the main model's last block, before its final norm) and
the embedding of token t_{i+k} (the shared embedding), and predicts t_{i+k+1} through its
own final norm and the shared output head:
    x_i   = eh_proj([enorm(emb(t_{i+k})) ; hnorm(h^{k-1}_i)])   (embedding first, the order of
                                                                DeepSeek's and Megatron's code)
    h^k   = block_k(x)                                         (a block as the model's last one)
    loss  = mtp_loss_coef / K * sum_k CE(lm_head(norm_k(h^k_i)), t_{i+k+1})
The last k positions of a sequence have no t_{i+k+1} and are masked at depth k (their
embedding id is 0, as Megatron's roll fills it). Position i's ids come from the labels:
t_{i+k} = labels[i+k-1], t_{i+k+1} = labels[i+k].
"""
import torch
import torch.nn as nn

from .cross_entropy import IGNORE, mean_token_loss
from .layers import Linear, make_norm


class MTPDepth(nn.Module):
    """One depth: enorm, hnorm, eh_proj, block, norm (DeepSeek-V3's checkpoint names, with
    `norm` for its shared_head.norm); the embedding and head are the model's."""

    def __init__(self, model_cfg, block: nn.Module):
        super().__init__()
        m = model_cfg
        self.enorm = make_norm(m.norm, m.d_model, m.norm_eps, m.bias)
        self.hnorm = make_norm(m.norm, m.d_model, m.norm_eps, m.bias)
        self.eh_proj = Linear(2 * m.d_model, m.d_model, bias=False, init_std=m.init_std)
        self.block = block
        self.norm = make_norm(m.norm, m.d_model, m.norm_eps, m.bias)

    def forward(self, h_BSD: torch.Tensor, e_BSD: torch.Tensor, cache=None) -> torch.Tensor:
        """h^k from h^{k-1} and the embeddings of the tokens k ahead (before norm); cache: the
        block's models/kv_cache.LayerKV when decoding (models/generation.py)."""
        x_BSD = self.eh_proj(torch.cat([self.enorm(e_BSD), self.hnorm(h_BSD)], dim=-1))
        return self.block(x_BSD) if cache is None else self.block(x_BSD, cache)


def shifted_labels(labels_BS: torch.Tensor, depth: int) -> list:
    """[(embedding ids, targets, count)] for depths 1..depth of whole sequences: position i
    gets t_{i+k} = labels[i+k-1] (0 past the end or where a label is ignored) and target
    t_{i+k+1} = labels[i+k] (IGNORE for the last k); count: the labelled targets (the loss's
    denominator)."""
    out = []
    for k in range(1, depth + 1):
        ids_BS = torch.zeros_like(labels_BS)
        ids_BS[:, :labels_BS.shape[1] - k + 1] = labels_BS[:, k - 1:].clamp_min(0)
        tgt_BS = torch.full_like(labels_BS, IGNORE)
        tgt_BS[:, :labels_BS.shape[1] - k] = labels_BS[:, k:]
        out.append((ids_BS, tgt_BS, (tgt_BS != IGNORE).sum()))
    return out


def mtp_losses(model, h_BSD: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """The K depths' cross entropies [K] (fp32, with their graph) of a GPT with `mtp`.

    `model.mtp_labels` (shifted_labels, or context parallelism's version that shifts across
    the cp ranks) gives each depth's ids, targets and the count the loss divides by."""
    losses = []
    for depth, (ids_BS, tgt_BS, count) in zip(model.mtp, model.mtp_labels(labels_BS, len(model.mtp))):
        h_BSD = depth(h_BSD, _embed_ahead(model, ids_BS))
        losses.append(mean_token_loss(depth_logits(model, depth, h_BSD), tgt_BS, count))
    return torch.stack(losses)


def depth_logits(model, depth: MTPDepth, h_BSD: torch.Tensor) -> torch.Tensor:
    """A depth's scores [B, S, V]: its own final norm, then the model's shared head."""
    return model.lm_head(depth.norm(h_BSD))


def _embed_ahead(model, ids_BS: torch.Tensor) -> torch.Tensor:
    """The shared embedding of the tokens ahead; on a pipeline's last stage, which holds no
    tok_emb, through the head's weight, the same matrix there (tied: parallel/pipeline/mtp.py)."""
    if model.tok_emb is not None:
        return model.embed(ids_BS)
    return model.drop(torch.nn.functional.embedding(ids_BS, model.lm_head.weight))


def weighted_mtp_loss(model):
    """(mtp_loss_coef / K x the sum of the last forward's depth losses, those losses [K]),
    or None for a model without MTP or a forward without labels."""
    terms_K = getattr(model, "mtp_loss", None)
    if terms_K is None:
        return None
    return model.model_cfg.mtp_loss_coef / terms_K.shape[0] * terms_K.sum(), terms_K
