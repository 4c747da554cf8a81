"""Routing records: the file `python -m trainer.generate --record-routing FILE` writes and
`moe.router_replay = FILE` trains on.

Shapes: N sequences, L tokens each (prompt + generated), M MoE layers, K experts per token.
One torch file holding a dict:
  format        "moekit.routing/1"
  tokens        long [N, L]: the sequences (training samples of data.seq_len + 1 = L tokens)
  expert_ids    int16 [N, M, L - 1, K]: the experts MoE layer m chose for position s when the
                sequence was generated (positions 0 .. L-2: the ones the model was fed; the
                training forward runs on exactly those)
  layers        [M] the MoE layers' names, in module order
  num_experts, top_k, vocab_size, prompt_tokens, checkpoint  what made it

Under train.py the record is the training split: the sampler draws its sequences as it draws
prepared token files', and each rank's rows bring their own ids (they travel with the tokens:
data parallel splits both, expert parallelism routes before any exchange). The validation split
stays the data source's.
"""
from pathlib import Path

import torch

FORMAT = "moekit.routing/1"


def save_record(path, tokens_NL, ids_NMSK, layers, *, num_experts: int, top_k: int,
                vocab_size: int, prompt_tokens: int, checkpoint: str) -> None:
    """Write atomically (a temp file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"format": FORMAT, "tokens": tokens_NL.cpu().long(),
                "expert_ids": ids_NMSK.cpu().to(torch.int16), "layers": list(layers),
                "num_experts": num_experts, "top_k": top_k, "vocab_size": vocab_size,
                "prompt_tokens": prompt_tokens, "checkpoint": checkpoint}, tmp)
    tmp.replace(path)


class RoutingRecord:
    """A loaded record: the training split (num_sequences, batch) plus ids(rows)."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"moe.router_replay={str(path)!r} does not exist; write one with "
                             f"python -m trainer.generate RUN_DIR --record-routing FILE")
        try:
            data = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one line
            raise ValueError(f"moe.router_replay={str(path)!r} is not a routing record "
                             f"({type(e).__name__})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"moe.router_replay={str(path)!r} is not a {FORMAT} record")
        self.data = data
        self.tokens_NL = data["tokens"]
        self.ids_NMSK = data["expert_ids"]
        self.num_sequences, self.length = self.tokens_NL.shape
        self.seq_len = self.length - 1

    def check(self, cfg, moe_layers: int) -> None:
        """One line naming the field to change when the run cannot train on this record."""
        d, where = self.data, f"moe.router_replay={str(self.path)!r}"
        wants = [("data.seq_len", cfg.data.seq_len, self.seq_len),
                 ("model.vocab_size", cfg.model.vocab_size, d["vocab_size"]),
                 ("moe.num_experts", cfg.moe.num_experts, d["num_experts"]),
                 ("moe.top_k", cfg.moe.top_k, d["top_k"])]
        for field, have, want in wants:
            if have != want:
                raise ValueError(f"{where} holds sequences for {field}={want}; this run has "
                                 f"{field}={have}: set {field}={want}")
        if len(d["layers"]) != moe_layers:
            raise ValueError(f"{where} records {len(d['layers'])} MoE layers, this model has "
                             f"{moe_layers}: train the model the record was generated with")

    def batch(self, indices) -> torch.Tensor:
        """Token samples [B, L] (a prepared TokenFile's form)."""
        return self.tokens_NL[torch.as_tensor(indices, dtype=torch.long)]

    def ids(self, indices) -> torch.Tensor:
        """long [B, M, L - 1, K]: the recorded experts of the samples' positions."""
        return self.ids_NMSK[torch.as_tensor(indices, dtype=torch.long)].long()
