"""`python -m trainer.generate RUN_DIR`: text from a trained run's checkpoint.

    python -m trainer.generate RUN_DIR --prompt TEXT [--step N] [--max-new-tokens 64]
        [--temperature 1.0] [--top-k 0] [--top-p 1.0] [--seed 0] [--num-samples 1]
        [--no-cache] [--speculative mtp] [--record-routing FILE] [section.field=value ...]

Loads the run's resolved config and its newest good checkpoint (or step N), written under any
layout, into one process (trainer/inference.py); MoE layers route dropless. Decoder-only models
(GPT, the HF decoder families) continue the prompt with a KV cache (--no-cache: recompute the
whole sequence each step, the reference); encoder-decoder models (Switch, T5) take the prompt as
the encoder input, where <extra_id_N> writes sentinel N, and decode the target. Output ids are
turned back into text by the run's tokenizer (bytes or BPE). --temperature 0 is greedy.

--record-routing FILE writes every MoE layer's expert choice for every position fed
(trainer/router_record.py), the sequences then being generated to exactly --max-new-tokens
tokens (no stop at end-of-text) so all have one length: train on them with
`train.py moe.router_replay=FILE data.seq_len=<prompt + new - 1>`.

--speculative mtp (a run trained with model.mtp_depth >= 1, greedy): the first MTP depth drafts
the next token and one forward of the main model checks it and gives the one after
(models/generation.generate_mtp_speculative); the output is the plain greedy output, and the
line after it gives the acceptance rate and the main model's forwards per token.
"""
import argparse
import re
import sys
import time

SENTINEL = re.compile(r"<extra_id_(\d+)>")


def _parser():
    p = argparse.ArgumentParser(prog="python -m trainer.generate",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run_dir", help="a train.py run directory (its run.dir)")
    p.add_argument("--prompt", required=True, help="text to continue ('' = start a new document)")
    p.add_argument("--step", type=int, help="checkpoint step to load (default: the newest good one)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = all")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same samples)")
    p.add_argument("--num-samples", type=int, default=1, help="continuations, decoded as one batch")
    p.add_argument("--no-cache", action="store_true",
                   help="decoder-only models: recompute the whole sequence every step (no KV cache)")
    p.add_argument("--speculative", choices=("off", "mtp"), default="off",
                   help="mtp: self-speculative greedy decoding, the MTP depth drafting a token ahead")
    p.add_argument("--record-routing", metavar="FILE",
                   help="write every MoE layer's experts for every position (for moe.router_replay)")
    p.add_argument("overrides", nargs="*", help="section.field=value on the run's config (e.g. run.device=cpu)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from trainer.config import ConfigError
    try:
        return _generate(args)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _check_args(args) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples={args.num_samples} must be >= 1")
    if args.record_routing and args.no_cache:
        raise ValueError("--record-routing records the KV-cached decode; drop --no-cache")
    if args.speculative == "mtp" and (args.temperature != 0 or args.no_cache or args.record_routing):
        raise ValueError("--speculative mtp decodes greedily with the KV cache; set --temperature 0 "
                         "and drop --no-cache / --record-routing")


def _generate(args) -> int:
    import torch

    from models.generation import Sampling, generate, generate_seq2seq
    from trainer.inference import load_run, run_tokenizer
    _check_args(args)
    sampling = Sampling(args.temperature, args.top_k, args.top_p).check()
    run = load_run(args.run_dir, args.step, args.overrides)
    tok = run_tokenizer(run.cfg)
    seq2seq = run.arch == "switch"
    if args.record_routing and seq2seq:
        raise ValueError("--record-routing: router replay trains decoder-only models (the run's "
                         "model is an encoder-decoder)")
    prompt = _encode(tok, args.prompt, run.cfg.model.vocab_size, seq2seq)
    _check_length(len(prompt), args.max_new_tokens, run.cfg.model.max_seq_len, seq2seq)
    print(run.describe())
    prompt_BP = torch.tensor([prompt] * args.num_samples, dtype=torch.long, device=run.device)
    gen = torch.Generator(device=run.device).manual_seed(args.seed)
    eos = None if args.record_routing else tok.eos_id
    t0 = time.perf_counter()
    recorder = None
    spec = None
    if args.speculative == "mtp":
        new_BN, spec = _speculative(run, prompt_BP, args.max_new_tokens, eos)
    elif seq2seq:
        new_BN = generate_seq2seq(run.model, prompt_BP, args.max_new_tokens, sampling, gen, eos)
    elif args.record_routing:
        from moe.replay import RoutingRecorder
        # the main model's layers: decoding runs no MTP depth (they have no routes to record)
        from moe.aux import moe_layers
        main = [(n, m) for n, m in moe_layers(run.model) if not n.startswith("mtp.")]
        with RoutingRecorder(run.model, main) as recorder:
            new_BN = generate(run.model, prompt_BP, args.max_new_tokens, sampling, gen, True, eos)
    else:
        new_BN = generate(run.model, prompt_BP, args.max_new_tokens, sampling, gen,
                          not args.no_cache, eos)
    dt = time.perf_counter() - t0
    mode = "encoder-decoder" if seq2seq else ("no cache" if args.no_cache else "KV cache")
    mode += ", MTP speculative" if spec is not None else ""
    print(f"generated {new_BN.numel()} tokens in {dt:.2f} s ({new_BN.numel() / dt:.1f} tokens/s, "
          f"{mode}, {'greedy' if sampling.temperature == 0 else f'seed {args.seed}'})")
    for i, row in enumerate(new_BN.tolist()):
        row = _cut(row, eos)
        head = f"--- sample {i + 1} ({len(row)} tokens) ---"
        text = _decode(tok, row, run.cfg.model.vocab_size, _sentinels(run.cfg) if seq2seq else 0)
        print(f"{head}\n{text if seq2seq else args.prompt + text}")
    if recorder is not None:
        _record(args, run, recorder, prompt_BP, new_BN, len(prompt))
    if spec is not None:
        print(f"MTP drafts accepted: {spec.accepted}/{spec.drafted} ({spec.acceptance:.1%}); "
              f"{spec.drafted + len(new_BN)} main-model forwards for {new_BN.numel()} tokens "
              f"(plain greedy: {new_BN.numel()})")
    return 0


def _speculative(run, prompt_BP, max_new: int, eos):
    """Each sample's greedy tokens by MTP self-speculation (one sequence at a time), padded
    with eos to one length as generate pads; and the drafts' counts over all samples."""
    import torch

    from models.generation import Speculation, generate_mtp_speculative
    if getattr(run.model, "mtp", None) is None:
        raise ValueError("--speculative mtp needs a run trained with model.mtp_depth >= 1 "
                         "(this one has no MTP depth)")
    spec, rows = Speculation(), []
    for row in prompt_BP.split(1):
        rows.append(generate_mtp_speculative(run.model, row, max_new, eos, spec))
    width = max(r.shape[1] for r in rows)
    fill = eos if eos is not None else 0
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=fill) for r in rows]), spec


def _record(args, run, recorder, prompt_BP, new_BN, prompt_len: int) -> None:
    import torch

    from trainer.router_record import save_record
    tokens_NL = torch.cat((prompt_BP, new_BN), dim=1)
    ids = recorder.ids()  # [N, M, L - 1, K]: the last token was never fed
    save_record(args.record_routing, tokens_NL, ids, [n for n, _ in recorder.layers],
                num_experts=run.cfg.moe.num_experts, top_k=run.cfg.moe.top_k,
                vocab_size=run.cfg.model.vocab_size, prompt_tokens=prompt_len,
                checkpoint=str(run.checkpoint))
    N, M, S, K = ids.shape
    print(f"routing record: {args.record_routing} ({N} sequences of {S + 1} tokens, {M} MoE "
          f"layers x {S} positions x top-{K}); train on it with moe.router_replay="
          f"{args.record_routing} data.seq_len={S}")


def _encode(tok, text: str, vocab_size: int, seq2seq: bool) -> list:
    """Prompt ids; an empty prompt starts a new document (the end-of-text id). In an encoder
    prompt <extra_id_N> is span-corruption sentinel N (id vocab_size - 1 - N)."""
    if not seq2seq:
        ids = tok.encode(text).tolist()
        return ids or [tok.eos_id]
    ids, pos = [], 0
    for m in SENTINEL.finditer(text):
        ids += tok.encode(text[pos:m.start()]).tolist() + [vocab_size - 1 - int(m.group(1))]
        pos = m.end()
    return ids + tok.encode(text[pos:]).tolist() + [tok.eos_id]


def _sentinels(cfg) -> int:
    """Sentinel ids span corruption uses for one training sample (the top of the vocabulary)."""
    from trainer.tasks import sentinels_needed
    return sentinels_needed(cfg.data.seq_len, cfg.data)


def _decode(tok, ids: list, vocab_size: int, sentinels: int) -> str:
    """Text of the ids; span-corruption sentinels as <extra_id_N>, other ids beyond the
    tokenizer's vocabulary (padding the model's) as <id N>."""
    out, run = [], []
    for i in ids:
        if i >= tok.vocab_size:
            out.append(tok.decode(run))
            run = []
            n = vocab_size - 1 - i
            out.append(f"<extra_id_{n}>" if n < sentinels else f"<id {i}>")
        else:
            run.append(i)
    return "".join(out) + tok.decode(run)


def _cut(row: list, eos) -> list:
    """The tokens before the first end-of-text."""
    return row[:row.index(eos)] if eos is not None and eos in row else row


def _check_length(prompt_len: int, new: int, max_seq_len: int, seq2seq: bool) -> None:
    if prompt_len > max_seq_len:
        raise ValueError(f"--prompt is {prompt_len} tokens, longer than the model's context "
                         f"(model.max_seq_len={max_seq_len}); shorten it")
    room = max_seq_len if seq2seq else max_seq_len - prompt_len + 1  # the last token is never fed
    if new > room:
        raise ValueError(f"--max-new-tokens={new} does not fit the model's context "
                         f"(model.max_seq_len={max_seq_len}, prompt {prompt_len} tokens); use "
                         f"--max-new-tokens <= {room}")


if __name__ == "__main__":
    sys.exit(main())
