"""Turning token samples into a loss, per model family.

Shapes: B sequences, S sequence length, V vocabulary.
gpt:    next-token prediction on samples of S+1 tokens.
switch: T5 span corruption of each sample (data/span_corruption.py), seeded by the sample's
        global index and the train seed, so every layout corrupts a sample identically.
"""
import torch

from models.cross_entropy import mean_token_loss


def token_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over labelled positions (label -100 = ignored), in fp32, without an
    fp32 copy of the whole logits (models/cross_entropy.py)."""
    return mean_token_loss(logits_BSV, labels_BS)


def switch_batch(samples_BS1, indices, seed: int, vocab_size: int, data_cfg) -> dict:
    """Span-corrupt each sample; returns input_ids, decoder_input_ids, labels tensors [B, *]."""
    from data.span_corruption import span_corrupt_batch
    out = span_corrupt_batch(samples_BS1.numpy(), seed, row_ids=indices, vocab_size=vocab_size,
                             noise_density=data_cfg.noise_density,
                             mean_span_length=data_cfg.mean_span_length)
    return {k: torch.from_numpy(out[k]) for k in ("input_ids", "decoder_input_ids", "labels")}


def sentinels_needed(seq_len: int, data_cfg) -> int:
    """Sentinel ids one span-corrupted sample of seq_len+1 tokens uses (ids above the text's)."""
    from data.span_corruption import corrupted_lengths
    L = seq_len + 1
    n_in, n_tgt = corrupted_lengths(L, data_cfg.noise_density, data_cfg.mean_span_length)
    return (n_in + n_tgt - L) // 2


def switch_loss(model, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["decoder_input_ids"])
    return token_loss(logits, batch["labels"])


class Task:
    """Moves a batch of samples to the device and computes the loss for the model family."""

    def __init__(self, arch: str, seed: int, vocab_size: int, data_cfg, device, seq_part=None):
        self.arch, self.seed, self.vocab_size = arch, seed, vocab_size
        self.data_cfg, self.device = data_cfg, device
        self.seq_part = seq_part  # [B, S] -> this rank's part (context parallelism), or None

    def prepare(self, samples_BS1: torch.Tensor, indices):
        if self.arch == "switch":
            batch = switch_batch(samples_BS1, indices, self.seed, self.vocab_size, self.data_cfg)
            return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return samples_BS1.to(self.device, non_blocking=True)

    def split(self, batch, n: int) -> list:
        """n equal micro-batches along the batch dim."""
        if isinstance(batch, dict):
            parts = {k: v.chunk(n) for k, v in batch.items()}
            return [{k: parts[k][i] for k in parts} for i in range(n)]
        return list(batch.chunk(n))

    def inputs_targets(self, samples_BS1) -> tuple:
        """gpt: (inputs, next-token targets) [B, S] of the samples, this rank's part of each
        sequence under context parallelism."""
        x_BS, y_BS = samples_BS1[:, :-1], samples_BS1[:, 1:]
        if self.seq_part is not None:
            x_BS, y_BS = self.seq_part(x_BS), self.seq_part(y_BS)
        return x_BS, y_BS

    def model_inputs(self, batch):
        """What the model's forward takes, from a prepared batch."""
        if self.arch == "switch":
            return batch["input_ids"], batch["decoder_input_ids"]
        return self.inputs_targets(batch)[0]

    def loss(self, model, batch, mtp: bool = True) -> torch.Tensor:
        """The main mean loss; a GPT with multi-token prediction (and mtp) also runs its
        depths, leaving their losses in model.mtp_loss (models/mtp.py)."""
        if self.arch == "switch":
            return switch_loss(model, batch)
        x_BS, y_BS = self.inputs_targets(batch)
        if mtp and getattr(model, "mtp", None) is not None:
            return token_loss(model(x_BS, labels_BS=y_BS), y_BS)
        return token_loss(model(x_BS), y_BS)

    def tokens(self, batch) -> int:
        """Tokens the model consumed (for tokens/s)."""
        if isinstance(batch, dict):
            return int(batch["input_ids"].numel() + batch["decoder_input_ids"].numel())
        return int(batch[:, :-1].numel())
