"""Keys and values of the tokens decoded so far, one LayerKV per block (inference only).

Shapes: B sequences, H key/value heads, L cached positions, Dh head width.
The cache is an argument of the model's forward (GPT.forward(ids, cache=...)), never kept on
a module: the caller owns it, and forward appends the new tokens' keys and values to it.
"""
import torch


class LayerKV:
    """One attention layer's cached keys and values [B, H, L, Dh] (before grouped-query
    repetition)."""

    def __init__(self):
        self.k_BHLD = self.v_BHLD = None

    @property
    def length(self) -> int:
        return 0 if self.k_BHLD is None else self.k_BHLD.shape[2]

    def extend(self, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor) -> tuple:
        """Append S new positions; returns the keys and values of all L + S."""
        if self.k_BHLD is None:
            self.k_BHLD, self.v_BHLD = k_BHSD, v_BHSD
        else:
            self.k_BHLD = torch.cat((self.k_BHLD, k_BHSD), dim=2)
            self.v_BHLD = torch.cat((self.v_BHLD, v_BHSD), dim=2)
        return self.k_BHLD, self.v_BHLD

    def truncate(self, length: int) -> None:
        """Forget the positions from `length` on (a rejected speculative token)."""
        if self.k_BHLD is not None:
            self.k_BHLD, self.v_BHLD = self.k_BHLD[:, :, :length], self.v_BHLD[:, :, :length]

    def select(self, rows) -> None:
        """Keep the given sequences (rows of B), e.g. those still decoding."""
        if self.k_BHLD is not None:
            self.k_BHLD, self.v_BHLD = self.k_BHLD[rows], self.v_BHLD[rows]


class KVCache:
    """A LayerKV per block of a decoder; `length` is the number of positions cached."""

    def __init__(self, n_layers: int):
        self.layers = [LayerKV() for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def truncate(self, length: int) -> None:
        for kv in self.layers:
            kv.truncate(length)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.layers
                   for t in (kv.k_BHLD, kv.v_BHLD) if t is not None)
