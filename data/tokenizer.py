"""Tokenizers: raw UTF-8 bytes (the default, nothing to train) or a byte-level BPE trained
locally with the `tokenizers` library and saved next to the token files it produced.

Both expose vocab_size, eos_id, encode(text) -> np.ndarray of ids, decode(ids) -> str.
"""
import json
from pathlib import Path

import numpy as np

TOKENIZER_KINDS = ("byte", "bpe")
EOS_TEXT = "<|eos|>"


class ByteTokenizer:
    """Ids are the bytes of the UTF-8 text. Byte 0 (NUL) never occurs in text, so it serves
    as the document separator and the vocabulary stays at exactly 256."""

    kind = "byte"
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> np.ndarray:
        data = text.encode("utf-8").replace(b"\0", b"")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 < int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def byte_lengths(self) -> np.ndarray:
        """Bytes of text each id stands for [vocab_size] (the separator: 0), for bits/byte."""
        lengths = np.ones(self.vocab_size, dtype=np.int64)
        lengths[self.eos_id] = 0
        return lengths


class BPETokenizer:
    """A `tokenizers.Tokenizer` (byte-level BPE) loaded from its tokenizer.json."""

    kind = "bpe"

    def __init__(self, path):
        from tokenizers import Tokenizer
        self.path = Path(path)
        self._tok = Tokenizer.from_file(str(self.path))
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = self._tok.token_to_id(EOS_TEXT)
        if self.eos_id is None:
            raise ValueError(f"{self.path} has no {EOS_TEXT} token; re-run data preparation")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def byte_lengths(self) -> np.ndarray:
        """Bytes of text each id stands for [vocab_size]: byte-level BPE spells every token
        with one symbol per byte; special tokens (end-of-text) stand for none."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        special = set(self._tok.get_added_tokens_decoder()) if hasattr(
            self._tok, "get_added_tokens_decoder") else {self.eos_id}
        for i in range(self.vocab_size):
            piece = self._tok.id_to_token(i)
            if piece is not None and i not in special:
                lengths[i] = len(piece)
        return lengths


def train_bpe(texts, vocab_size: int, path) -> BPETokenizer:
    """Train a byte-level BPE on an iterable of strings and save it to `path` (tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if vocab_size < 300:
        raise ValueError(f"data.vocab_size={vocab_size} is too small for BPE (256 byte symbols "
                         f"+ merges); use >= 300, or data.tokenizer='byte'")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return BPETokenizer(path)


def load_tokenizer(data_dir):
    """The tokenizer a prepared data directory was made with (from its meta.json)."""
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    if meta["tokenizer"] == "byte":
        return ByteTokenizer()
    return BPETokenizer(Path(data_dir) / "tokenizer.json")
