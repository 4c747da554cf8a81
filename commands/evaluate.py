"""`python -m trainer.evaluate RUN_DIR`: loss, perplexity, bits per byte and per-layer expert
load of a trained run's checkpoint on a data source.

    python -m trainer.evaluate RUN_DIR [--data SOURCE] [--split val|all] [--max-tokens N]
        [--step N] [--batch-size N] [--out DIR] [--json] [section.field=value ...]

Without --data it reads the run's own held-out set, the sequences train.py's evaluation reads
(train.eval_batches x train.batch_size, trainer/evaluation.py), so its loss is the run's
val_loss at that step when the run trained dropless. With --data it reads any source
data.source accepts (stdlib, a folder of text files, a saved HF dataset), tokenized with the
run's tokenizer: its validation documents (the ones data.val_fraction holds out, --split val)
or all of them, up to --max-tokens, cut into samples of data.seq_len + 1 tokens as training
cuts them. Bits per byte: the summed loss in bits over the UTF-8 bytes the predicted tokens
spell (decoder-only models; a span-corruption target is not a text stream, so none there).
The expert load comes from the load profiler over the same forwards (moe/profiling:
the table `python -m trainer.profile` prints; --out DIR also writes load.json, load.png and
TensorBoard there). The checkpoint loads as trainer.generate loads it (trainer/inference.py):
one process, any saved layout, MoE routing dropless.
"""
import argparse
import json
import math
import os
import sys


def _parser():
    p = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run_dir", help="a train.py run directory (its run.dir)")
    p.add_argument("--data", help="data source (as data.source); default: the run's held-out set")
    p.add_argument("--split", choices=("val", "all"), default="val",
                   help="with --data: the source's validation documents (data.val_fraction) or all")
    p.add_argument("--max-tokens", type=int, default=65536,
                   help="with --data: stop reading the source after this many tokens (0 = all)")
    p.add_argument("--step", type=int, help="checkpoint step to load (default: the newest good one)")
    p.add_argument("--batch-size", type=int, help="sequences per forward (default: train.batch_size)")
    p.add_argument("--out", help="also write load.json, load.png and tensorboard/ here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("overrides", nargs="*", help="section.field=value on the run's config")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from trainer.config import ConfigError
    try:
        result = _evaluate(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0


def _evaluate(args) -> dict:
    import torch

    from moe.profiling import profile_model
    from trainer.inference import load_run, run_tokenizer
    from trainer.tasks import Task
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size={args.batch_size} must be >= 1")
    if args.max_tokens < 0:
        raise ValueError(f"--max-tokens={args.max_tokens} must be >= 0 (0 = all)")
    run = load_run(args.run_dir, args.step, args.overrides)
    cfg, tok = run.cfg, run_tokenizer(run.cfg)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the run's tokenizer has {tok.vocab_size} ids, more than "
                         f"model.vocab_size={cfg.model.vocab_size}")
    batch_size = args.batch_size or cfg.train.batch_size
    task = Task(run.arch, cfg.train.seed, cfg.model.vocab_size, cfg.data, run.device)
    samples, where = _samples(args, cfg, tok, batch_size)
    prepared = [task.prepare(s, idx) for s, idx in samples]
    score = _Score(run.arch, task, prepared, torch.from_numpy(tok.byte_lengths()))
    if not args.json:
        print(run.describe())
        print(f"data: {where}")
    report = profile_model(run.model, [task.model_inputs(b) for b in prepared], args.out,
                           tokenizer=tok, ep=(run.trained_ep, cfg.moe.replica_slots),
                           on_output=score.add)
    result = score.result()
    result["layers"] = report["layers"]
    if not args.json:
        _print(result)
        from commands.profile import print_summary
        print_summary(report, sys.stdout)
        if args.out:
            print(f"wrote {os.path.join(args.out, 'load.json')}, {os.path.join(args.out, 'load.png')}, "
                  f"{os.path.join(args.out, 'tensorboard')}")
    return result


def _samples(args, cfg, tok, batch_size: int):
    """([(samples [B, S+1], indices)], a line saying what they are)."""
    from data.prepare import prepared_dir
    from data.sampler import open_split

    from trainer.evaluation import held_out
    if args.data is None:
        val = open_split(prepared_dir(cfg.data), "val", cfg.data.seq_len)
        chunks = held_out(val, _Raw(), cfg.train.eval_batches, cfg.train.batch_size, chunk=batch_size)
        out = [(s, idx) for _, (s, idx) in chunks]
        n = sum(len(idx) for _, idx in out)
        return out, (f"the run's held-out set ({n} sequences of {cfg.data.seq_len + 1} tokens: "
                     f"train.eval_batches={cfg.train.eval_batches} x train.batch_size="
                     f"{cfg.train.batch_size})")
    return _source_samples(args, cfg, tok, batch_size)


class _Raw:
    """held_out's task argument: hand back the samples and their indices unprepared."""

    def prepare(self, samples, indices):
        return samples, indices


def _source_samples(args, cfg, tok, batch_size: int):
    import numpy as np
    import torch

    from data.prepare import iter_documents, val_every
    every = val_every(cfg.data.val_fraction)
    stream, docs = [], 0
    for i, text in enumerate(iter_documents(args.data, cfg.data.text_field)):
        if args.split == "val" and i % every:
            continue
        stream.append(np.append(tok.encode(text), tok.eos_id))
        docs += 1
        if args.max_tokens and sum(map(len, stream)) >= args.max_tokens:
            break
    tokens = np.concatenate(stream) if stream else np.zeros(0, dtype=np.int64)
    if args.max_tokens:
        tokens = tokens[:args.max_tokens]
    S = cfg.data.seq_len
    n = (len(tokens) - 1) // S
    if n < 1:
        raise ValueError(f"--data {args.data!r} ({args.split} split) gave {len(tokens)} tokens, "
                         f"fewer than one sample of data.seq_len+1={S + 1}; use --split all or "
                         f"raise --max-tokens")
    rows = torch.from_numpy(np.stack([tokens[i * S: i * S + S + 1] for i in range(n)]).astype(np.int64))
    out = [(rows[i:i + batch_size], list(range(i, min(i + batch_size, n))))
           for i in range(0, n, batch_size)]
    split = "validation documents" if args.split == "val" else "documents"
    return out, (f"{args.data} ({docs} {split}, {n} samples of {S + 1} tokens, "
                 f"{n * S} predicted tokens)")


class _Score:
    """Summed token loss (nats), predicted tokens and their bytes, from each batch's logits."""

    def __init__(self, arch: str, task, prepared: list, byte_len_V):
        self.arch, self.task, self.prepared, self.byte_len_V = arch, task, prepared, byte_len_V
        self.nats = 0.0
        self.tokens = self.bytes = 0

    def add(self, i: int, logits_BSV) -> None:
        import torch.nn.functional as F
        labels_BS = self._labels(self.prepared[i])
        keep = labels_BS != -100
        self.nats += float(F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten(),
                                           ignore_index=-100, reduction="sum"))
        self.tokens += int(keep.sum())
        if self.arch == "gpt":
            self.bytes += int(self.byte_len_V[labels_BS[keep].cpu()].sum())

    def _labels(self, batch):
        if self.arch == "switch":
            return batch["labels"]
        return self.task.inputs_targets(batch)[1]

    def result(self) -> dict:
        loss = self.nats / self.tokens
        bpb = self.nats / math.log(2) / self.bytes if self.bytes else None
        return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": bpb,
                "tokens": self.tokens, "bytes": self.bytes if self.arch == "gpt" else None}


def _print(r: dict) -> None:
    bpb = "" if r["bits_per_byte"] is None else (
        f"  bits/byte {r['bits_per_byte']:.4f} ({r['bytes']} bytes)")
    print(f"loss {r['loss']:.4f}  perplexity {r['perplexity']:.2f}{bpb}  over {r['tokens']} "
          f"predicted tokens")


if __name__ == "__main__":
    sys.exit(main())
