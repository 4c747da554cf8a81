"""Turn text into memory-mappable token files: train.bin, val.bin (flat token ids, documents
separated by the tokenizer's eos id), meta.json and, for BPE, tokenizer.json.

Sources: "stdlib" (the embedded corpus, data/corpus.py), a folder of text files (every
non-binary file below it, sorted by relative path), or a Hugging Face dataset saved with
`save_to_disk` (needs the `datasets` package; nothing is downloaded). Document i goes to the
validation split when i % round(1/val_fraction) == 0, so both splits sample the whole source.

    python -m data.prepare SOURCE --out DIR [--tokenizer byte|bpe] [--vocab-size N]
"""
import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from .corpus import read_text, stdlib_files
from .tokenizer import TOKENIZER_KINDS, ByteTokenizer, train_bpe

FORMAT_VERSION = 1


def _folder_files(folder: Path) -> list:
    files = []
    for p in sorted(folder.rglob("*"), key=lambda q: q.relative_to(folder).as_posix()):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts):
            with open(p, "rb") as f:
                if b"\0" not in f.read(8192):  # skip binary files
                    files.append(p)
    return files


def _is_hf_dataset(folder: Path) -> bool:
    return any((folder / n).exists() for n in ("dataset_info.json", "dataset_dict.json", "state.json"))


def _hf_texts(folder: Path, text_field: str):
    try:
        import datasets
    except ImportError:
        raise RuntimeError(f"{folder} looks like a Hugging Face dataset; reading it needs the "
                           f"`datasets` package (pip install datasets)") from None
    ds = datasets.load_from_disk(str(folder))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[sorted(ds.keys())[0]]
    if text_field not in ds.column_names:
        raise ValueError(f"data.text_field={text_field!r} is not a column of {folder}; "
                         f"columns: {ds.column_names}")
    for row in ds:
        yield row[text_field]


def _source_listing(source: str):
    """(kind, files or folder) for a source string; raises a clear error for a bad one."""
    if source == "stdlib":
        return "stdlib", stdlib_files()
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"data.source={source!r} is neither 'stdlib' nor an existing "
                                f"folder; give a folder of text files or a saved HF dataset")
    if _is_hf_dataset(folder):
        return "hf", folder
    files = _folder_files(folder)
    if not files:
        raise ValueError(f"data.source={source!r} holds no text files")
    return "folder", files


def iter_documents(source: str, text_field: str = "text", max_bytes: int = 0):
    """Documents of a source in a deterministic order, stopping once max_bytes (>0) is read."""
    kind, listing = _source_listing(source)
    texts = _hf_texts(listing, text_field) if kind == "hf" else (read_text(p) for p in listing)
    total = 0
    for text in texts:
        if not text:
            continue
        yield text
        total += len(text.encode("utf-8"))
        if 0 < max_bytes <= total:
            return


def cache_key(source, tokenizer, vocab_size, val_fraction, max_bytes, text_field) -> str:
    kind, listing = _source_listing(source)
    if kind == "hf":
        listing = sorted(p for p in listing.rglob("*") if p.is_file())
    files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in listing]
    blob = json.dumps([FORMAT_VERSION, source, tokenizer, vocab_size, val_fraction, max_bytes,
                       text_field, files])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def val_every(val_fraction: float) -> int:
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1), e.g. 0.05")
    return max(2, round(1 / val_fraction))


def prepare(source, out_dir, tokenizer="byte", vocab_size=4096, val_fraction=0.05,
            max_bytes=0, text_field="text") -> Path:
    """Tokenize `source` into `out_dir`, written atomically (temp dir, then rename)."""
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"data.tokenizer={tokenizer!r} is not supported; use one of {TOKENIZER_KINDS}")
    every = val_every(val_fraction)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        docs = lambda: iter_documents(source, text_field, max_bytes)  # noqa: E731
        if tokenizer == "byte":
            tok = ByteTokenizer()
        else:
            train_docs = (t for i, t in enumerate(docs()) if i % every != 0)
            tok = train_bpe(train_docs, vocab_size, tmp / "tokenizer.json")
        dtype = np.uint16 if tok.vocab_size <= 2 ** 16 else np.uint32
        counts = {"train": 0, "val": 0}
        num_docs = 0
        with open(tmp / "train.bin", "wb") as ftrain, open(tmp / "val.bin", "wb") as fval:
            for i, text in enumerate(docs()):
                ids = np.append(tok.encode(text), tok.eos_id).astype(dtype)
                split = "val" if i % every == 0 else "train"
                (fval if split == "val" else ftrain).write(ids.tobytes())
                counts[split] += len(ids)
                num_docs += 1
        if counts["val"] == 0 or counts["train"] == 0:
            raise ValueError(f"data.source={source!r} gave {num_docs} document(s): too few for a "
                             f"train and a validation split; add text or raise data.val_fraction")
        meta = {"format": FORMAT_VERSION, "source": str(source), "tokenizer": tok.kind,
                "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                "dtype": np.dtype(dtype).name, "documents": num_docs,
                "train_tokens": counts["train"], "val_tokens": counts["val"]}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def prepared_dir(data_cfg) -> Path:
    """The prepared directory for a DataConfig, preparing it into the cache if needed.

    A source that already holds meta.json (the output of `python -m data.prepare`) is used
    as is. Under several processes call it on one rank first, barrier, then on the others
    (they find the finished cache entry).
    """
    src = Path(str(data_cfg.source)).expanduser()
    if data_cfg.source != "stdlib" and (src / "meta.json").is_file():
        return src
    key = cache_key(data_cfg.source, data_cfg.tokenizer, data_cfg.vocab_size,
                    data_cfg.val_fraction, data_cfg.max_bytes, data_cfg.text_field)
    name = "stdlib" if data_cfg.source == "stdlib" else src.name
    out = Path(data_cfg.cache_dir).expanduser() / f"{name}-{data_cfg.tokenizer}-{key}"
    if not (out / "meta.json").is_file():
        prepare(data_cfg.source, out, data_cfg.tokenizer, data_cfg.vocab_size,
                data_cfg.val_fraction, data_cfg.max_bytes, data_cfg.text_field)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="'stdlib', a folder of text files, or a saved HF dataset folder")
    ap.add_argument("--out", required=True, help="output folder (replaced atomically)")
    ap.add_argument("--tokenizer", default="byte", choices=TOKENIZER_KINDS)
    ap.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--max-bytes", type=int, default=0, help="stop after this much text (0 = all)")
    ap.add_argument("--text-field", default="text", help="column holding text in an HF dataset")
    args = ap.parse_args(argv)
    try:
        out = prepare(args.source, args.out, args.tokenizer, args.vocab_size, args.val_fraction,
                      args.max_bytes, args.text_field)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(json.loads((out / "meta.json").read_text()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
