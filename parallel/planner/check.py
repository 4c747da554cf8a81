"""Check the layout a user already has: `--layout "tp2 pp8 vp4 ep64 mbs1"`.

Words (any may be omitted; an omitted degree takes the config's [parallel] value, dp the
ranks left over):
  dpN cpN tpN ppN epN etpN   degrees
  vpN                        model chunks per pipeline rank (virtual stages); vp > 1 picks
                             interleaved_1f1b unless a schedule word is given
  mN                         pipeline micro-batches per step
  mbsN                       sequences per micro-batch (pp > 1: m = batch / (dp x N);
                             otherwise train.micro_batch_size)
  zN                         ZeRO stage
  rc                         full recomputation
  ring | ulysses             context-parallel mode
  off=optimizer|params       ZeRO-Offload
  2d | 2.5dN                 tensor-parallel grid (2.5d with depth N)
  a schedule name            1f1b, gpipe, interleaved_1f1b, zb_interleaved, zbv, dualpipev, 2bw
The smallest change that makes a layout fit: every layout one change away (a higher ZeRO
stage, recomputation, offload, twice the tp / pp / ep / cp / etp degree, twice the
micro-batches), validated and predicted; those that fit, fastest first; when none does,
pairs of those changes.
"""
import dataclasses
import re

from ..pipeline.schedules import PP_SCHEDULES

_DEGREE = re.compile(r"^(dp|cp|tp|pp|vp|ep|etp|mbs|m|z)(\d+)$")
_FIELDS = {"dp": "dp", "cp": "cp", "tp": "tp", "pp": "pp", "vp": "pp_stages_per_rank",
           "ep": "ep", "etp": "etp", "m": "microbatches", "z": "zero"}


def parse_layout(text: str, base, batch_size: int) -> tuple:
    """(ParallelPlan fields changed from `base`, micro_batch_size or 0); ValueError naming
    the word."""
    fields, mbs, schedule = {"dp": -1}, 0, None
    for word in text.replace(",", " ").split():
        w = word.lower()
        m = _DEGREE.match(w)
        if m:
            key, n = m.group(1), int(m.group(2))
            if key == "mbs":
                mbs = n
            else:
                fields[_FIELDS[key]] = n
        elif w in PP_SCHEDULES:
            schedule = w
        elif w in ("rc", "recompute"):
            fields["recompute"] = "full"
        elif w.startswith("rc="):  # selective: rc=layernorm+moe_act
            fields["recompute"], fields["recompute_modules"] = "selective", w[3:].replace("+", ",")
        elif w in ("ring", "ulysses"):
            fields["cp_mode"] = w
        elif w.startswith("off="):
            fields["offload"] = w[4:]
        elif w == "2d":
            fields["tp_mode"] = "2d"
        elif w.startswith("2.5d"):
            fields["tp_mode"], fields["tp_depth"] = "2.5d", int(w[4:] or 2)
        else:
            hint = _did_you_mean(w)
            raise ValueError(f"--layout: {word!r} is not a layout word{hint} (dpN cpN tpN ppN vpN "
                             f"epN etpN mN mbsN zN rc rc=part+part ring|ulysses off=optimizer|params "
                             f"2d 2.5dN or a schedule: {', '.join(PP_SCHEDULES)})")
    pp = fields.get("pp", base.pp)
    if schedule is None and fields.get("pp_stages_per_rank", 0) > 1:
        schedule = "interleaved_1f1b"
    if schedule is not None:
        fields["pp_schedule"] = schedule
    if pp > 1 and "pp_stages_per_rank" not in fields:
        fields["pp_stages_per_rank"] = 0
    if mbs and pp > 1 and "microbatches" not in fields:
        fields["microbatches"] = -mbs  # resolved once dp is known (resolve_microbatches)
    return fields, (mbs if pp == 1 else 0)


# long names a user may type for a degree word's prefix
_ALIASES = {"zero": "z", "stage": "z", "data": "dp", "tensor": "tp", "pipe": "pp", "pipeline": "pp",
            "expert": "ep", "experts": "ep", "context": "cp", "virtual": "vp", "vpp": "vp",
            "microbatch": "m", "microbatches": "m", "mb": "mbs", "etep": "etp"}


def _did_you_mean(word: str) -> str:
    """"; did you mean 'z1'?" for a misspelt layout word, else ""."""
    import difflib
    m = re.match(r"^([a-z_.]+?)[=_-]?(\d+)$", word)
    if m:
        head, n = m.group(1), m.group(2)
        short = _ALIASES.get(head) or next(iter(difflib.get_close_matches(head, _FIELDS.keys() | {"mbs"}, 1)), None)
        if short:
            return f"; did you mean {short + n!r}?"
    close = difflib.get_close_matches(word, list(PP_SCHEDULES) + ["rc", "ring", "ulysses", "2d"], 1)
    return f"; did you mean {close[0]!r}?" if close else ""


def resolve_microbatches(plan, world: int, batch_size: int):
    """A plan whose microbatches were given as -mbs: m = batch / (dp x mbs)."""
    if plan.microbatches >= 0:
        return plan
    mbs = -plan.microbatches
    dp = world // (plan.cp * plan.tp * plan.pp)
    if dp < 1 or batch_size % (dp * mbs):
        raise ValueError(f"--layout mbs{mbs}: the per-rank batch train.batch_size/dp = "
                         f"{batch_size}/{max(dp, 1)} is not a multiple of {mbs}")
    return dataclasses.replace(plan, microbatches=batch_size // (dp * mbs))


# the selective sets the fit search tries: Megatron-Bridge's recipes' (Qwen3: the norms and
# the activations; DeepSeek-V3: MLA's up-projections and the dense MLPs) and the experts'
SELECTIVE_SETS = ("layernorm,moe_act", "mla_up_proj,mlp", "layernorm,moe_act,experts")


def one_changes(plan) -> list:
    """[(description, fields)]: the single changes that lower a rank's memory."""
    out = [(f"parallel.zero={z}", {"zero": z}) for z in range(plan.zero + 1, 4)]
    if plan.recompute == "none":
        out.append(("parallel.recompute=full", {"recompute": "full"}))
        for parts in SELECTIVE_SETS:  # a set naming a part the model lacks is refused: skipped
            out.append((f"parallel.recompute=selective recompute_modules={parts}",
                        {"recompute": "selective", "recompute_modules": parts}))
    if plan.offload == "none":
        out.append(("parallel.offload=optimizer", {"offload": "optimizer", "zero": max(plan.zero, 1)}))
    for name in ("tp", "pp", "ep", "cp", "etp"):
        v = getattr(plan, name)
        change = {name: 2 * v, "dp": -1}
        if name == "pp" and v == 1:
            change["microbatches"] = 2
        out.append((f"parallel.{name}={2 * v}", change))
    if plan.pp > 1:
        out.append((f"parallel.microbatches={2 * plan.microbatches}", {"microbatches": 2 * plan.microbatches}))
    return out


def fixes(try_plan, plan, limit: int = 3) -> list:
    """[(description, Prediction)] of the layouts one (else two) changes from `plan` that fit,
    fastest first; try_plan(plan) -> Prediction or None (refused)."""
    singles = one_changes(plan)
    found = _fitting(try_plan, plan, [(d, f) for d, f in singles])
    if not found:
        pairs = [(f"{d1} + {d2}", {**f1, **f2}) for i, (d1, f1) in enumerate(singles)
                 for d2, f2 in singles[i + 1:] if not (set(f1) - {"dp"}) & (set(f2) - {"dp"})]
        found = _fitting(try_plan, plan, pairs)
    return sorted(found, key=lambda dp_: dp_[1].step_s)[:limit]


def _fitting(try_plan, plan, changes) -> list:
    out = []
    for desc, fields in changes:
        pred = try_plan(dataclasses.replace(plan, **fields))
        if pred is not None and pred.fits:
            out.append((desc, pred))
    return out


def breakdown(pred) -> list:
    """Per stage: {"rank", device: {params, grads, optimizer, activations, buffers}} in bytes;
    buffers = what the peak phase holds beyond the four (gathered ZeRO-3 units, flat
    reduction copies, optimizer temporaries)."""
    out = []
    for s in pred.stages:
        row = {"rank": s.rank}
        for device in ("gpu", "cpu"):
            kinds = {k: s.model_state[k].get(device, 0) for k in ("params", "grads", "optimizer")}
            if device == "gpu":
                kinds["activations"] = s.activation_bytes
                kinds["buffers"] = max(0, s.memory["peak"] - sum(kinds.values()))
            row[device] = kinds
        out.append(row)
    return out
