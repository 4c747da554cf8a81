"""Context parallelism (parallel/context/): what cp composes with, the model and routing it
serves, and the sequence length its 2*cp load-balanced chunks need."""
from __future__ import annotations  # ParallelPlan (parallel/plan.py) is named in hints only

from . import _err
from .experts import _has_moe


def _check_cp(p: ParallelPlan) -> None:
    """Context parallelism composes with dp, ep, etp, 1-D tp (+SP), the synchronous 1F1B family
    of pipeline schedules, ZeRO 1/2/3, recomputation, bf16 and the a2a overlap; the rest is
    refused here, before any collective."""
    if p.cp == 1:
        return
    for bad, why in ((p.tp_mode != "1d", f"parallel.tp_mode={p.tp_mode}: the grid splits the sequence "
                                         f"its own way; use tp_mode='1d'"),
                     (p.pp > 1 and p.pp_schedule not in ("1f1b", "gpipe", "interleaved_1f1b"),
                      f"parallel.pp_schedule={p.pp_schedule}: context parallelism runs with the "
                      f"1F1B family (1f1b, gpipe, interleaved_1f1b)"),
                     (p.ps_servers > 0, "parallel.ps_servers: the parameter server keeps whole "
                                        "replicas per worker; set ps_servers=0"),
                     (p.offload != "none", f"parallel.offload={p.offload}: not combined with "
                                           f"context parallelism yet; set offload='none'"),
                     (p.zeropp_quantize_weights or p.zeropp_quantize_grads or p.zeropp_hpz,
                      "ZeRO++ (parallel.zeropp_*): not combined with context parallelism yet; "
                      "turn it off"),
                     (p.compile, "parallel.compile=true: the ring's send/recv are not traced; set "
                                 "compile=false"),
                     (p.precision == "fp16", "parallel.precision='fp16': use bf16 (no loss "
                                             "scaling needed)")):
        if bad:
            raise _err(f"parallel.cp={p.cp} with {why}")


def _check_cp_model(p: ParallelPlan, m, moe_cfg) -> None:
    arch = getattr(m, "arch", "gpt")
    if arch != "gpt":
        raise _err(f"parallel.cp={p.cp} is implemented for model.arch='gpt' only (got {arch!r}: "
                   f"relative-position bias and cross attention over a split sequence are not); "
                   f"set parallel.cp=1")
    heads = getattr(m, "n_heads", None)
    if p.cp_mode == "ulysses" and heads is not None and (heads // p.tp) % p.cp:
        raise _err(f"parallel.cp_mode=ulysses needs the attention heads per tp rank (model.n_heads="
                   f"{heads} / parallel.tp={p.tp}) divisible by parallel.cp={p.cp}; use "
                   f"parallel.cp_mode=ring or a cp dividing {heads // p.tp}")
    if p.cp_mode == "ring" and getattr(m, "dropout", 0.0) > 0:
        raise _err(f"parallel.cp_mode=ring with model.dropout={m.dropout}: the ring kernel has no "
                   f"attention-probability dropout; set model.dropout=0 or parallel.cp_mode=ulysses")
    if _has_moe(moe_cfg) and moe_cfg.capacity_factor is not None:
        raise _err(f"moe.capacity_factor={moe_cfg.capacity_factor} with parallel.cp={p.cp}: capacity "
                   f"is decided per sequence, which cp splits over ranks; use dropless routing "
                   f"(moe.capacity_factor=none) or parallel.cp=1")
    if _has_moe(moe_cfg) and moe_cfg.router != "token_choice":
        raise _err(f"moe.router={moe_cfg.router} with parallel.cp={p.cp}: experts choose among a "
                   f"sequence's tokens, which cp splits over ranks; use moe.router=token_choice")


def check_cp_seq_len(seq_len: int, cp: int, tp: int, where: str) -> None:
    """The sequence is cut into 2 x cp chunks (load balance), and each rank's S/cp tokens
    into tp parts by sequence parallelism."""
    if cp > 1 and seq_len % (2 * cp * tp):
        step = 2 * cp * tp
        raise _err(f"{where}={seq_len} is not divisible by 2 x parallel.cp x parallel.tp = {step} "
                   f"(context parallelism cuts each sequence into 2*cp chunks"
                   + (", sequence parallelism each rank's part into tp" if tp > 1 else "")
                   + f"); use a multiple of {step}, e.g. {max(step, seq_len - seq_len % step)}")
