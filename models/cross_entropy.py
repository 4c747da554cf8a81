"""Cross entropy over a large vocabulary without a full fp32 copy of the logits.

Shapes: N labelled positions (B*S flattened), V vocabulary.

`F.cross_entropy(logits.float())` on bf16 logits keeps three [N, V] tensors alive into the
backward: the bf16 logits, their fp32 copy and the fp32 log-probabilities it saves, and the
backward makes an fp32 [N, V] gradient before casting it to bf16. For Qwen3's vocabulary
(151,936) and 16k tokens that is 10 GB per fp32 copy. `chunked_cross_entropy` saves only the
logits and one fp32 log-sum-exp per row; it walks the rows in chunks of about CHUNK_BYTES of
fp32 in the forward (log-sum-exp and target logit) and again in the backward (softmax minus
one-hot, in the logits' dtype), each chunk one fused op (ce_chunk, ce_chunk_grad_). Per row
the arithmetic is the same fp32 arithmetic as torch's; only the order of the final sum over
rows differs (fp32 rounding). fp64 logits are handled in fp64 throughout (accumulation_dtype), so
an fp64 proof stays fp64 up to its loss.
"""
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from moe.dtypes import accumulation_dtype
from moe.fusion import run_fused

CHUNK_BYTES = 1 << 30  # fp32 bytes of one chunk of rows: large enough that launches stay few
IGNORE = -100


def chunk_rows(n_rows: int, vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: at least one, at most every row."""
    return max(1, min(n_rows, chunk_bytes // (4 * vocab)))


def _chunk_forward(logits_RV, target_R, valid_R):
    x_RV = logits_RV.to(accumulation_dtype(logits_RV.dtype))
    lse_R = torch.logsumexp(x_RV, dim=-1)
    picked_R = x_RV.gather(1, target_R.unsqueeze(1)).squeeze(1)
    return lse_R, torch.where(valid_R, lse_R - picked_R, 0.0).sum()


def _chunk_backward(logits_RV, target_R, lse_R, scale_R, grad_RV):
    p_RV = (logits_RV.to(lse_R.dtype) - lse_R.unsqueeze(1)).exp()
    p_RV = p_RV.scatter_add(1, target_R.unsqueeze(1), torch.full_like(lse_R, -1.0).unsqueeze(1))
    grad_RV.copy_(p_RV * scale_R.unsqueeze(1))


# One op per chunk and direction: on CUDA each is one inductor-fused kernel (moe/fusion.py)
# reading the bf16 logits once (and writing the gradient once), where eager ops would make an
# fp32 copy and several full passes; the op census counts them as the fused kernels they are.
@torch.library.custom_op("moekit::ce_chunk", mutates_args=())
def ce_chunk(logits_RV: torch.Tensor, target_R: torch.Tensor,
             valid_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 log-sum-exp per row, fp32 sum of the labelled rows' losses)."""
    return run_fused(_chunk_forward, logits_RV, logits_RV, target_R, valid_R)


@torch.library.custom_op("moekit::ce_chunk_grad_", mutates_args=("grad_RV",))
def ce_chunk_grad_(logits_RV: torch.Tensor, target_R: torch.Tensor, lse_R: torch.Tensor,
                   scale_R: torch.Tensor, grad_RV: torch.Tensor) -> None:
    """grad_RV = (softmax - one-hot) x the row's scale, in grad_RV's (the logits') dtype."""
    run_fused(_chunk_backward, logits_RV, logits_RV, target_R, lse_R, scale_R, grad_RV)


@ce_chunk.register_fake
def _(logits_RV, target_R, valid_R):
    dtype = accumulation_dtype(logits_RV.dtype)
    return logits_RV.new_empty(logits_RV.shape[0], dtype=dtype), logits_RV.new_empty((), dtype=dtype)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, labels_N, rows: int, count=None):
        valid_N = labels_N != IGNORE
        target_N = labels_N.clamp_min(0)
        lse, total = [], []
        for s in range(0, logits_NV.shape[0], rows):
            lse_R, total_R = ce_chunk(logits_NV[s:s + rows], target_N[s:s + rows], valid_N[s:s + rows])
            lse.append(lse_R)
            total.append(total_R)
        count = valid_N.sum() if count is None else count
        lse_N = lse[0] if len(lse) == 1 else torch.cat(lse)
        ctx.save_for_backward(logits_NV, target_N, valid_N, lse_N, count)
        ctx.rows = rows
        return (total[0] if len(total) == 1 else torch.stack(total).sum()) / count

    @staticmethod
    def backward(ctx, grad):
        logits_NV, target_N, valid_N, lse_N, count = ctx.saved_tensors
        rows = ctx.rows
        scale_N = torch.where(valid_N, grad / count, 0.0)
        grad_NV = torch.empty_like(logits_NV)
        for s in range(0, logits_NV.shape[0], rows):
            ce_chunk_grad_(logits_NV[s:s + rows], target_N[s:s + rows], lse_N[s:s + rows],
                           scale_N[s:s + rows], grad_NV[s:s + rows])
        return grad_NV, None, None, None


def chunked_cross_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor,
                          chunk_bytes: int = CHUNK_BYTES, count=None) -> torch.Tensor:
    """Mean cross entropy over labelled rows (label -100: ignored) in fp32, as
    F.cross_entropy(logits_NV.float(), labels_N, ignore_index=-100) computes it; `count`
    (a tensor): divide the rows' sum by it instead of by the labelled rows here."""
    rows = chunk_rows(logits_NV.shape[0], logits_NV.shape[-1], chunk_bytes)
    return _ChunkedCrossEntropy.apply(logits_NV, labels_N, rows, count)


def mean_token_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, count=None) -> torch.Tensor:
    """Mean cross entropy over labelled positions (label -100 = ignored), in fp32, without an
    fp32 copy of the whole logits; `count` as chunked_cross_entropy's."""
    V = logits_BSV.shape[-1]
    if isinstance(logits_BSV, DTensor):  # a sharded vocabulary: torch's own loss handles it
        total = F.cross_entropy(logits_BSV.to(accumulation_dtype(logits_BSV.dtype)).reshape(-1, V), labels_BS.reshape(-1),
                                ignore_index=IGNORE, reduction="sum")
        return total / ((labels_BS != IGNORE).sum() if count is None else count)
    return chunked_cross_entropy(logits_BSV.reshape(-1, V), labels_BS.reshape(-1), count=count)
