"""Tensor parallelism (parallel/tensor/): the 2-D / 2.5-D grid's shape and what it does not
serve, the attention heads each tp form splits, the model sizes the grid divides, and the
sequence length 1-D tp's sequence parallelism splits."""
from __future__ import annotations  # ParallelPlan (parallel/plan.py) is named in hints only

from . import _err
from .experts import _has_moe


def check_seq_len(seq_len: int, tp: int, where: str) -> None:
    """Sequence parallelism splits every sequence into tp equal parts between blocks."""
    if tp > 1 and seq_len % tp:
        lower, upper = seq_len - seq_len % tp, seq_len - seq_len % tp + tp
        raise _err(f"{where}={seq_len} is not divisible by parallel.tp={tp} (sequence parallelism "
                   f"splits each sequence into tp equal parts); use a multiple of {tp}, e.g. "
                   f"{lower or upper} or {upper}")


def _check_tp_mode(p: ParallelPlan) -> None:
    """2d: tp = q*q; 2.5d: tp = q*q*tp_depth (parallel/tensor/grid.py), with the combinations
    the grid layout does not serve refused."""
    d = p.tp_depth
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise _err(f"parallel.tp_depth={d!r} must be an integer >= 1")
    if p.tp_mode != "2.5d" and d != 1:
        raise _err(f"parallel.tp_depth={d} stacks 2-D grids and needs parallel.tp_mode='2.5d' "
                   f"(got {p.tp_mode!r}); set tp_mode='2.5d' or tp_depth=1")
    if p.tp_mode == "1d":
        return
    q = round((p.tp // d) ** 0.5) if p.tp % d == 0 else 0
    if q < 2 or q * q * d != p.tp:
        shape = "q*q" if p.tp_mode == "2d" else f"q*q*tp_depth (tp_depth={d})"
        raise _err(f"parallel.tp={p.tp} with tp_mode={p.tp_mode!r} must be {shape} for a grid side "
                   f"q >= 2; use tp={4 * d} (q=2) or tp={9 * d} (q=3), or tp_mode='1d'")
    if p.zero == 3:
        raise _err(f"parallel.tp_mode={p.tp_mode} with parallel.zero=3: FSDP2 shards over one "
                   f"tensor-parallel mesh dim and the grid's weights are split over two; use "
                   f"parallel.zero=1 or 2 (or tp_mode='1d')")
    if p.compile:
        raise _err(f"parallel.tp_mode={p.tp_mode} with parallel.compile=true is not supported (the "
                   f"grid modules' collectives are not traced); set compile=false")


def _check_tp_attention(p: ParallelPlan, m) -> None:
    """1d splits the query and key/value heads tp ways; mla and the grid are not split yet."""
    if getattr(m, "attention", "mha") == "mla" and p.tp_mode != "1d":
        raise _err(f"parallel.tp_mode={p.tp_mode} with model.attention='mla' is not implemented "
                   f"(the grid splits d_model-wide heads); use tp_mode='1d', which splits MLA's "
                   f"heads as Megatron does")
    kv = getattr(m, "n_kv_heads", 0)
    if p.tp_mode == "1d" and kv and kv % p.tp:
        raise _err(f"model.n_kv_heads={kv} is not divisible by parallel.tp={p.tp}; pick a tp that "
                   f"divides it")
    if p.tp_mode != "1d" and (kv or getattr(m, "qk_norm", False) or getattr(m, "head_dim", 0)):
        raise _err(f"parallel.tp_mode={p.tp_mode} with model.n_kv_heads/head_dim/qk_norm is not "
                   f"implemented (the grid splits d_model-wide heads); use tp_mode='1d'")


def _check_grid_model(p: ParallelPlan, m, moe_cfg) -> None:
    """The q x q grid splits heads, d_model, d_ff and the vocab q ways each."""
    q = p.tp_grid
    sizes = [("n_heads", getattr(m, "n_heads", None)), ("d_model", getattr(m, "d_model", None)),
             ("d_ff", getattr(m, "d_ff", None)), ("vocab_size", getattr(m, "vocab_size", None))]
    for name, v in sizes:
        if v is not None and v % q:
            raise _err(f"model.{name}={v} is not divisible by the grid side q={q} (parallel.tp={p.tp}, "
                       f"tp_mode={p.tp_mode}); change model.{name} or parallel.tp")
    if getattr(m, "bias", False):
        raise _err(f"parallel.tp_mode={p.tp_mode} with model.bias=true is not implemented (the grid "
                   f"modules hold no biases); set model.bias=false or tp_mode='1d'")
    if _has_moe(moe_cfg) and getattr(moe_cfg, "shared_expert_gate", False):
        raise _err(f"parallel.tp_mode={p.tp_mode} with moe.shared_expert_gate=true is not "
                   f"implemented (the gate reads whole tokens, the grid splits them); set "
                   f"moe.shared_expert_gate=false or tp_mode='1d'")
