"""Decoding from a trained model: greedy or sampled continuations of a prompt.

Shapes: B samples, P prompt length, N new tokens, V vocabulary, T target length.

Decoder-only models (GPT, the HF decoder families) continue the prompt; with use_cache the
prompt runs once and every later step feeds only the newest token, reading the keys and values
of the earlier ones from the model's cache (model.new_cache(), forward(ids, cache=)); without
it every step runs the whole sequence again (the reference the cache is tested against).
Encoder-decoder models (Switch, HF T5) encode the prompt once and decode the target step by
step from it.

A sample stops at eos_id (its later positions repeat eos and are cut by the caller) unless
stop_at_eos is off. Sampling draws from `generator`, so a seed repeats a sample exactly.
"""
from dataclasses import dataclass

import torch

from .mtp import depth_logits


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy (argmax)
    top_k: int = 0            # keep the k most likely tokens; 0: all
    top_p: float = 1.0        # keep the smallest set whose probability reaches p; 1: all

    def check(self) -> "Sampling":
        if self.temperature < 0:
            raise ValueError(f"--temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"--top-k={self.top_k} must be >= 0 (0 = no limit)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p={self.top_p} must lie in (0, 1] (1 = no limit)")
        return self


def next_tokens(logits_BV: torch.Tensor, s: Sampling, generator=None) -> torch.Tensor:
    """One token per row [B]: argmax at temperature 0, else a draw from the softmax of
    logits / temperature restricted to the top-k and then the top-p (nucleus) set."""
    if s.temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV.float() / s.temperature
    if s.top_k and s.top_k < logits_BV.shape[-1]:
        kth_B1 = logits_BV.topk(s.top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if s.top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        # drop a token when the more likely ones already reach top_p (the first always stays)
        drop_BV = probs_BV.cumsum(dim=-1) - probs_BV >= s.top_p
        logits_BV = logits_BV.scatter(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    probs_BV = logits_BV.softmax(dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


def _finish(tok_B, done_B, eos_id):
    """Rows already done keep emitting eos; returns (tokens, done)."""
    if eos_id is None:
        return tok_B, done_B
    tok_B = torch.where(done_B, torch.full_like(tok_B, eos_id), tok_B)
    return tok_B, done_B | (tok_B == eos_id)


@torch.no_grad()
def generate(model, prompt_BP: torch.Tensor, max_new: int, sampling: Sampling,
             generator=None, use_cache: bool = True, eos_id=None) -> torch.Tensor:
    """New tokens [B, N <= max_new] continuing a decoder-only model's prompts (all of length
    P); stops early once every row has emitted eos_id (None: never)."""
    seq_BL = prompt_BP
    cache = model.new_cache() if use_cache else None
    logits_BV = model(prompt_BP, cache=cache)[:, -1] if use_cache else model(prompt_BP)[:, -1]
    done_B = torch.zeros(prompt_BP.shape[0], dtype=torch.bool, device=prompt_BP.device)
    new = []
    for n in range(max_new):
        tok_B, done_B = _finish(next_tokens(logits_BV, sampling, generator), done_B, eos_id)
        new.append(tok_B)
        if bool(done_B.all()) or n == max_new - 1:
            break
        if use_cache:
            logits_BV = model(tok_B[:, None], cache=cache)[:, -1]
        else:
            seq_BL = torch.cat((seq_BL, tok_B[:, None]), dim=1)
            logits_BV = model(seq_BL)[:, -1]
    return torch.stack(new, dim=1) if new else prompt_BP[:, :0]


@torch.no_grad()
def generate_seq2seq(model, source_BS: torch.Tensor, max_new: int, sampling: Sampling,
                     generator=None, eos_id=None, start_id: int = 0) -> torch.Tensor:
    """Target tokens [B, N <= max_new] of an encoder-decoder model (encode / decode_logits)
    for the source ids; the decoder starts from start_id (T5 and span corruption: 0)."""
    enc_BSD = model.encode(source_BS)
    tgt_BT = torch.full((source_BS.shape[0], 1), start_id, dtype=source_BS.dtype,
                        device=source_BS.device)
    done_B = torch.zeros(source_BS.shape[0], dtype=torch.bool, device=source_BS.device)
    for _ in range(max_new):
        logits_BV = model.decode_logits(tgt_BT, enc_BSD)[:, -1]
        tok_B, done_B = _finish(next_tokens(logits_BV, sampling, generator), done_B, eos_id)
        tgt_BT = torch.cat((tgt_BT, tok_B[:, None]), dim=1)
        if bool(done_B.all()):
            break
    return tgt_BT[:, 1:]


@dataclass
class Speculation:
    """What self-speculative decoding with the MTP depth did: drafts made and accepted."""
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@torch.no_grad()
def generate_mtp_speculative(model, prompt_1P: torch.Tensor, max_new: int, eos_id=None,
                             stats: Speculation | None = None) -> torch.Tensor:
    """Greedy new tokens [1, N <= max_new] of a GPT with MTP (model.mtp_depth >= 1), the
    same tokens `generate` gives at temperature 0, in fewer passes of the main model: depth 1
    drafts token n+1 from the main model's last hidden state and the embedding of token n;
    one forward of the main model over (token n, draft) both checks the draft (its greedy
    token at n equals the draft: accepted) and gives the token after it, so an accepted draft
    adds two tokens per forward, a rejected one the main model's own token (the draft's
    position leaves the KV cache). One sequence at a time (its cache length is its own).
    Invariant: the main and the MTP caches hold positions < n; tokens t_0..t_n are known."""
    stats = stats if stats is not None else Speculation()
    depth, cache, mtp_cache = model.mtp[0], model.new_cache(), model.new_cache().layers[0]
    h_1PD = model.hidden(prompt_1P, cache)
    tok = model.logits(h_1PD[:, -1:]).argmax(-1)                       # t_n, n = P
    known = torch.cat([prompt_1P, tok], dim=1)
    draft = _draft(model, depth, mtp_cache, h_1PD, known[:, 1:])      # t_{n+1}
    new, stop = [tok], eos_id is not None and int(tok) == eos_id
    while len(new) < max_new and not stop:
        n = known.shape[1] - 1
        h_12D = model.hidden(torch.cat([known[:, -1:], draft], dim=1), cache)
        greedy = model.logits(h_12D).argmax(-1)                         # t_{n+1}, t_{n+2}
        stats.drafted += 1
        if bool((greedy[:, 0] == draft[:, 0]).all()):
            stats.accepted += 1
            got, h_used = greedy, h_12D
        else:
            cache.truncate(n + 1)                                       # forget the draft's position
            got, h_used = greedy[:, :1], h_12D[:, :1]
        known = torch.cat([known, got], dim=1)
        new.extend(got.split(1, dim=1))
        stop = eos_id is not None and bool((got == eos_id).any())
        draft = _draft(model, depth, mtp_cache, h_used, got)
    out = torch.cat(new, dim=1)[:, :max_new]
    eos = [] if eos_id is None else (out[0] == eos_id).nonzero().flatten().tolist()
    return out[:, :eos[0] + 1] if eos else out  # as generate: up to the first eos


def _draft(model, depth, mtp_cache, h_1SD, next_1S) -> torch.Tensor:
    """MTP depth 1 over new positions (their main hidden states and the tokens after them):
    the greedy draft [1, 1] of the token after the last one known."""
    h1_1SD = depth(h_1SD, model.embed(next_1S, mtp_cache.length), cache=mtp_cache)
    return depth_logits(model, depth, h1_1SD[:, -1:]).argmax(-1)
