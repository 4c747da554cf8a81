"""Cross entropy over a large vocabulary without a full fp32 copy of the logits.

Shapes: N labelled positions (B*S flattened), V vocabulary.

`F.cross_entropy(logits.float())` on bf16 logits keeps three [N, V] tensors alive into the
backward: the bf16 logits, their fp32 copy and the fp32 log-probabilities it saves, and the
backward makes an fp32 [N, V] gradient before casting it to bf16. For Qwen3's vocabulary
(151,936) and 16k tokens that is 10 GB per fp32 copy. `chunked_cross_entropy` saves only the
logits and one fp32 log-sum-exp per row; it walks the rows in chunks of about CHUNK_BYTES of
fp32 in the forward (log-sum-exp and target logit) and again in the backward (softmax minus
one-hot, written straight into the logits' dtype). Per row the arithmetic is the same fp32
arithmetic as torch's; only the order of the final sum over rows differs (fp32 rounding).
"""
import torch

CHUNK_BYTES = 1 << 30  # fp32 bytes of one chunk of rows: large enough that launches stay few
IGNORE = -100


def chunk_rows(n_rows: int, vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: at least one, at most every row."""
    return max(1, min(n_rows, chunk_bytes // (4 * vocab)))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, labels_N, rows: int):
        valid_N = labels_N != IGNORE
        target_N1 = labels_N.clamp_min(0).unsqueeze(1)
        lse_N = torch.empty(logits_NV.shape[0], dtype=torch.float32, device=logits_NV.device)
        total = torch.zeros((), dtype=torch.float32, device=logits_NV.device)
        for s in range(0, logits_NV.shape[0], rows):
            x_RV = logits_NV[s:s + rows].float()
            lse_R = torch.logsumexp(x_RV, dim=-1)
            lse_N[s:s + rows] = lse_R
            picked_R = x_RV.gather(1, target_N1[s:s + rows]).squeeze(1)
            total = total + torch.where(valid_N[s:s + rows], lse_R - picked_R, 0.0).sum()
        count = valid_N.sum()
        ctx.save_for_backward(logits_NV, target_N1, valid_N, lse_N, count)
        ctx.rows = rows
        return total / count

    @staticmethod
    def backward(ctx, grad):
        logits_NV, target_N1, valid_N, lse_N, count = ctx.saved_tensors
        rows = ctx.rows
        scale_N1 = torch.where(valid_N, grad / count, 0.0).unsqueeze(1)
        grad_NV = torch.empty_like(logits_NV)
        for s in range(0, logits_NV.shape[0], rows):
            p_RV = (logits_NV[s:s + rows].float() - lse_N[s:s + rows, None]).exp_()
            p_RV.scatter_add_(1, target_N1[s:s + rows], torch.full_like(target_N1[s:s + rows], -1,
                                                                       dtype=p_RV.dtype))
            grad_NV[s:s + rows] = p_RV.mul_(scale_N1[s:s + rows])
        return grad_NV, None, None


def chunked_cross_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor,
                          chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Mean cross entropy over labelled rows (label -100: ignored) in fp32, as
    F.cross_entropy(logits_NV.float(), labels_N, ignore_index=-100) computes it."""
    rows = chunk_rows(logits_NV.shape[0], logits_NV.shape[-1], chunk_bytes)
    return _ChunkedCrossEntropy.apply(logits_NV, labels_N, rows)
