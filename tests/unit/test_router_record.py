"""Routing records (trainer/router_record.py) and the byte counts bits/byte rests on.

A record refuses a run it cannot feed with one line naming the field and its value; an absent
or foreign file is named as such. Byte-level BPE and the byte tokenizer count, for any text,
exactly its UTF-8 bytes over the ids it encodes to (the end-of-text id: none)."""
import pytest
import torch

from trainer.config import load_config
from trainer.router_record import RoutingRecord, save_record


def _record(tmp_path, N=4, L=9, M=2, K=2, E=4):
    path = tmp_path / "r.pt"
    save_record(path, torch.randint(1, 200, (N, L)), torch.randint(0, E, (N, M, L - 1, K)),
                [f"blocks.{i}.ffn" for i in range(M)], num_experts=E, top_k=K, vocab_size=256,
                prompt_tokens=3, checkpoint="x")
    return path


def test_record_reads_back_by_row(tmp_path):
    path = _record(tmp_path)
    rec = RoutingRecord(path)
    data = torch.load(path, weights_only=True)
    assert (rec.num_sequences, rec.seq_len) == (4, 8)
    assert torch.equal(rec.batch([2, 0]), data["tokens"][[2, 0]])
    assert torch.equal(rec.ids([3]), data["expert_ids"][[3]].long())
    assert not list(tmp_path.glob(".*tmp"))  # written through a temp file, renamed


@pytest.mark.parametrize("overrides, layers, words", [
    (["data.seq_len=16"], 2, "set data.seq_len=8"),
    (["data.seq_len=8", "model.vocab_size=512"], 2, "set model.vocab_size=256"),
    (["data.seq_len=8", "moe.num_experts=8"], 2, "set moe.num_experts=4"),
    (["data.seq_len=8", "moe.num_experts=4", "moe.top_k=1"], 2, "set moe.top_k=2"),
    (["data.seq_len=8", "moe.num_experts=4"], 3, "records 2 MoE layers, this model has 3"),
])
def test_record_refuses_a_run_it_cannot_feed(tmp_path, overrides, layers, words):
    rec = RoutingRecord(_record(tmp_path))
    with pytest.raises(ValueError, match=words):
        rec.check(load_config(None, overrides), layers)


def test_missing_or_foreign_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        RoutingRecord(tmp_path / "none.pt")
    torch.save({"tokens": torch.zeros(2, 3)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a moekit.routing/1 record"):
        RoutingRecord(tmp_path / "other.pt")
    (tmp_path / "junk.pt").write_text("junk")
    with pytest.raises(ValueError, match="is not a routing record"):
        RoutingRecord(tmp_path / "junk.pt")


def test_byte_lengths_count_utf8_bytes(tmp_path):
    from data.tokenizer import ByteTokenizer, train_bpe
    texts = ["def foo(x):\n    return x * 2  # é ü 中文\n"] * 40 + ["import os, sys\n"] * 40
    for tok in (ByteTokenizer(), train_bpe(texts, 320, tmp_path / "tok.json")):
        lengths = tok.byte_lengths()
        assert lengths.shape == (tok.vocab_size,) and lengths[tok.eos_id] == 0
        for text in ("def foo(x): é 中文 return", "hello wörld\n\tok", ""):
            assert lengths[tok.encode(text)].sum() == len(text.encode("utf-8")), (tok.kind, text)
