"""Data: tokenizers, corpus listing, prepare (token files), sampler determinism and resume."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

from data.corpus import stdlib_files
from data.prepare import main as prepare_main
from data.prepare import prepare, prepared_dir
from data.sampler import BatchSampler, eval_indices, open_split
from data.tokenizer import ByteTokenizer, load_tokenizer

DOCS = {"a.txt": "hello world\n" * 20, "sub/b.md": "def f(x):\n    return x + 1\n" * 15,
        "c.py": "import os\nprint(os.getcwd())\n" * 10, "d.txt": "caf\u00e9 \u00fcber na\u00efve\n" * 12}


@pytest.fixture
def text_dir(tmp_path):
    root = tmp_path / "texts"
    for rel, text in DOCS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "blob.bin").write_bytes(b"\0\1\2binary")  # skipped: not text
    return root


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "x = 'caf\u00e9'\n\tprint(x)"
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and ids.max() < tok.vocab_size and (ids != tok.eos_id).all()
    assert tok.decode(ids) == text
    assert len(tok.encode("a\0b")) == 2  # NUL is reserved as the document separator


def test_prepare_folder_splits_and_is_deterministic(tmp_path, text_dir):
    a = prepare(str(text_dir), tmp_path / "a", val_fraction=0.25)
    b = prepare(str(text_dir), tmp_path / "b", val_fraction=0.25)
    meta = json.loads((a / "meta.json").read_text())
    assert meta["documents"] == 4 and meta["vocab_size"] == 256
    for split in ("train", "val"):
        assert (a / f"{split}.bin").read_bytes() == (b / f"{split}.bin").read_bytes()
    toks = np.fromfile(a / "train.bin", dtype=meta["dtype"])
    val = np.fromfile(a / "val.bin", dtype=meta["dtype"])
    assert len(toks) == meta["train_tokens"] and len(val) == meta["val_tokens"]
    # document 0 in sorted order (a.txt) is the validation document (i % 4 == 0)
    assert ByteTokenizer().decode(val) == DOCS["a.txt"]
    assert (toks == 0).sum() == 3  # one separator per training document
    assert not list(tmp_path.glob(".*tmp*"))  # the temp dir was renamed away


def test_prepare_bpe_and_cache(tmp_path, text_dir):
    cfg = SimpleNamespace(source=str(text_dir), tokenizer="bpe", vocab_size=300,
                          val_fraction=0.25, max_bytes=0, text_field="text",
                          cache_dir=str(tmp_path / "cache"))
    out = prepared_dir(cfg)
    assert prepared_dir(cfg) == out  # cached: same key, not rebuilt
    tok = load_tokenizer(out)
    assert tok.kind == "bpe" and 256 < tok.vocab_size <= 300
    text = DOCS["sub/b.md"]
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text.encode())  # merges compress
    # a prepared dir is used as is
    assert prepared_dir(SimpleNamespace(**{**vars(cfg), "source": str(out)})) == out


def test_prepare_errors(tmp_path, text_dir):
    with pytest.raises(FileNotFoundError, match="data.source"):
        prepare(str(tmp_path / "nope"), tmp_path / "o")
    with pytest.raises(ValueError, match="data.val_fraction"):
        prepare(str(text_dir), tmp_path / "o", val_fraction=1.5)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "dataset_info.json").write_text("{}")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="datasets"):
            prepare(str(tmp_path / "hf"), tmp_path / "o")
    assert prepare_main([str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()  # nothing written on error


def test_stdlib_corpus_is_sorted_and_clean():
    files = stdlib_files()
    assert len(files) > 100
    rel = [f.as_posix() for f in files]
    assert not any("/site-packages/" in r or "/test/" in r for r in rel)
    assert files == stdlib_files()


def _global_batches(n_seq, batch, seed, steps, dp):
    out = []
    samplers = [BatchSampler(n_seq, batch, seed, r, dp) for r in range(dp)]
    for _ in range(steps):
        out.append(np.concatenate([s.next_indices() for s in samplers]))
    return out


def test_sampler_layout_invariant_and_covers_epochs():
    one = _global_batches(10, 4, seed=3, steps=5, dp=1)
    two = _global_batches(10, 4, seed=3, steps=5, dp=2)
    four = _global_batches(10, 4, seed=3, steps=5, dp=4)
    for a, b, c in zip(one, two, four):
        assert (a == b).all() and (a == c).all()
    flat = np.concatenate(one)  # 20 draws = two epochs: each index exactly twice
    assert sorted(np.bincount(flat, minlength=10).tolist()) == [2] * 10
    assert not (np.concatenate(_global_batches(10, 4, 4, 5, 1)) == flat).all()  # seed matters
    with pytest.raises(ValueError, match="train.batch_size"):
        BatchSampler(10, 3, 0, 0, 2)


def test_sampler_exact_resume():
    ref = BatchSampler(37, 6, seed=1)
    want = [ref.next_indices() for _ in range(12)]
    s = BatchSampler(37, 6, seed=1)
    for _ in range(5):
        s.next_indices()
    state = s.state_dict()
    resumed = BatchSampler(37, 6, seed=1, dp_rank=1, dp_size=2)  # another layout
    resumed.load_state_dict(state)
    for i in range(5, 12):
        assert (resumed.next_indices() == want[i][3:]).all()
    with pytest.raises(ValueError, match="train.seed"):
        BatchSampler(37, 6, seed=2).load_state_dict(state)


def test_token_file_samples_and_eval_indices(tmp_path, text_dir):
    out = prepare(str(text_dir), tmp_path / "p", val_fraction=0.25)
    f = open_split(out, "train", seq_len=8)
    raw = np.fromfile(out / "train.bin", dtype=json.loads((out / "meta.json").read_text())["dtype"])
    b = f.batch([0, 2])
    assert b.shape == (2, 9)
    assert b[1].tolist() == raw[16:25].tolist()  # sample i = tokens [i*S, i*S+S+1)
    whole = eval_indices(100, 8, 0, 1)
    parts = np.concatenate([eval_indices(100, 8, r, 2) for r in range(2)])
    assert (whole == parts).all() and len(set(whole.tolist())) == 8
    with pytest.raises(ValueError, match="data.seq_len"):
        open_split(out, "val", seq_len=10 ** 6)
