"""ParallelPlan: how many ranks each kind of parallelism uses, checked before any collective.

Rank layout (outer to inner): pp x dp x tp = world. The dense side uses the mesh
("pp", "dp", "tp"). The expert side reuses the same ranks: within one pipeline stage the
dp*tp ranks form a pool of distinct token streams (under tp, MoE layers route each tp
rank's part of the sequences, or whole sequences split across the tp ranks where a capacity
or expert choice needs them: every token is routed once), and that pool is
regrouped as ("edp", "ep", "etp") with etp innermost (parallel folding: the expert side's
degrees are independent of the dense side's). So **ep*etp must divide dp*tp** (not only dp):
ep=2 tp=2 dp=1 puts experts across the tp pair. etp ranks split each expert's d_ff
(expert tensor parallelism); edp = dp*tp/(ep*etp) ranks hold the same expert slices and
average their gradients (or shard them under ZeRO).

`validate` never communicates: it is pure arithmetic on the plan, the world size and the
model/MoE/batch sizes, and every error names the field and a fix.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Union

from moe.config import routes_per_sequence

from .pipeline.layers import parse as parse_layers
from .pipeline.layers import resolve as resolve_layers
from .pipeline.schedules import (MULTI_STAGE_SCHEDULES, PP_SCHEDULES, V_SCHEDULES, ZERO_BUBBLE,
                                 stage_ids)

TP_MODES = ("1d", "2d", "2.5d")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")   # parallel/fp8.py (torchao's recipe names)
RECOMPUTE = ("none", "full", "selective")
# parallel.recompute=selective's parts (parallel/recompute.py; Megatron's names)
RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "mlp", "mla_up_proj", "shared_experts",
                     "experts")
CP_MODES = ("ring", "ulysses")
OFFLOADS = ("none", "optimizer", "params")
PARAM_DTYPES = ("fp32", "bf16")
A2A_OVERLAPS = ("none", "1f1b")
def _toml(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


# settings the start-up layout line shows when they differ from the default
_SHOWN_IF_SET = ("gpus_per_node", "a2a_overlap", "recompute", "recompute_modules", "compile", "offload", "zero_prefetch", "ps_servers", "ps_staleness", "zeropp_quantize_weights", "zeropp_hpz",
                 "zeropp_quantize_grads")


@dataclass
class ParallelPlan:
    dp: int = field(default=-1, metadata={"help": "data-parallel degree; -1 = all ranks left after tp*pp"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel degree (attention heads, dense MLP, vocab split)"})
    tp_mode: str = field(default="1d", metadata={"help": "tensor-parallel form: 1d (Megatron column/row + sequence parallel) | 2d (Optimus: tp = q*q grid, SUMMA matmuls) | 2.5d (Tesseract: tp = q*q*tp_depth, tp_depth stacked q x q grids)"})
    tp_depth: int = field(default=1, metadata={"help": "2.5d only: number of stacked q x q grids (the batch is split over them, weights replicated)"})
    pp: int = field(default=1, metadata={"help": "pipeline-parallel degree (number of ranks in the pipeline)"})
    cp: int = field(default=1, metadata={"help": "context-parallel degree: each sequence split over cp ranks (load-balanced chunks); cp ranks hold copies of the dense weights and fold into expert parallelism (ep divides dp*cp*tp)"})
    cp_mode: str = field(default="ring", metadata={"help": "context parallelism: ring (key/value blocks around the cp ring, exact log-sum-exp merge) | ulysses (all-to-all into a head split; heads divisible by cp)"})
    ep: int = field(default=1, metadata={"help": "expert-parallel degree; must divide dp*cp*tp and moe.num_experts"})
    etp: int = field(default=1, metadata={"help": "expert tensor parallelism: each routed expert's d_ff split over etp ranks (ep*etp must divide dp*cp*tp)"})
    zero: int = field(default=0, metadata={"help": "ZeRO stage: 0 DP, 1 optimizer state, 2 +grads, 3 +params (FSDP2)"})
    pp_schedule: str = field(default="1f1b", metadata={"help": "pipeline schedule: 1f1b | gpipe | interleaved_1f1b | zb_interleaved (interleaved zero bubble) | zbv (zero bubble, V-shape stages) | dualpipev (DeepSeek-V3's DualPipe, V-shape) | 2bw (PipeDream-2BW: asynchronous, 2 weight versions, each update uses the gradient of the previous weights)"})
    pp_stages_per_rank: int = field(default=0, metadata={"help": "model chunks per pipeline rank; 0 = auto (2 for interleaved_1f1b, zb_interleaved, zbv and dualpipev, else 1)"})
    pp_layers: str = field(default="", metadata={"help": "blocks per pipeline stage: '' = even (n_layers divisible by the stages) | 'auto' = balanced by predicted time and parameters (the embedding on the first stage, head and loss on the last) | '3,4,4,3' = explicit, one count per stage (pp x stages per rank); stages without MoE layers are fine under any ep"})
    microbatches: int = field(default=0, metadata={"help": "pipeline microbatches per optimizer step (pp>1 only); 0 = auto: pp (one per stage)"})
    precision: str = field(default="fp32", metadata={"help": "fp32 | bf16 (autocast, fp32 master weights and router) | fp16 (dynamic loss scaling) | fp8 (bf16 plus FP8 GEMMs: expert banks -- routed, shared, dense FFNs -- in DeepSeek-V3's 1x128-tile / 128x128-block scaling, other Linears of the blocks through torchao float8 with parallel.fp8_recipe; embedding, head, norms and routers stay bf16/fp32; parallel/fp8.py)"})
    fp8_recipe: str = field(default="tensorwise", metadata={"help": "precision=fp8 only: torchao's float8 recipe for the blocks' nn.Linears (attention projections): tensorwise (default; one scale per tensor, the fastest) | rowwise (one scale per row: more accurate with outliers)"})
    param_dtype: str = field(default="fp32", metadata={"help": "parameters and gradients: fp32 | bf16 (held in bf16, 2+2 bytes per parameter, with fp32 master slices and optimizer state in ZeRO-1/2; under ZeRO-3 FSDP2 gathers and reduces in bf16, its fp32 shards the masters: the ZeRO paper's mixed precision, K=12; needs zero 1-3 and precision=bf16; checkpoints keep the fp32 masters)"})
    a2a_overlap: str = field(default="none", metadata={"help": "none | 1f1b: with two or more micro-batches per step (train.micro_batch_size), run the forward of micro-batch i+1 beside the backward of micro-batch i, switching at every expert all-to-all so one's exchange flies while the other computes (Megatron's combined 1F1B, DualPipe's overlap; parallel/interleave.py); under pp > 1 the schedule's neighbouring forward/backward pairs (zbv, dualpipev; the 1F1B family is refused: its pairs delay the next stage; parallel/pipeline/paired_steps.py); same function; one micro-batch's activations plus the next one's up to its first MoE block (under pp: at least two micro-batch-chunks); needs ep > 1"})
    recompute: str = field(default="none", metadata={"help": "activation recomputation: none | full (recompute each block in backward) | selective (only the parts parallel.recompute_modules names)"})
    recompute_modules: Union[str, list] = field(default="", metadata={"help": "recompute=selective: the parts recomputed in backward, a TOML list or comma-separated: core_attn (attention core), layernorm (the norms' outputs), moe_act (the experts' activation), mlp (dense FFNs), mla_up_proj (MLA's up-projections), shared_experts, experts (the routed experts' GEMMs); parallel/recompute.py"})
    compile: bool = field(default=False, metadata={"help": "torch.compile each block after parallelization"})
    offload: str = field(default="none", metadata={"help": "ZeRO-Offload: none | optimizer (fp32 master, optimizer state and step on the host; zero 1-3) | params (also the sharded parameters and gradients; zero 3)"})
    zero_prefetch: int = field(default=0, metadata={"help": "zero 3: explicit FSDP2 prefetch, all-gather the next n blocks' parameters while this one computes (forward) and the previous n (backward); costs n more unsharded blocks of memory; 0 = FSDP2's implicit one-ahead"})
    ps_servers: int = field(default=0, metadata={"help": "parameter-server layout: S shards of the parameters and optimizer state on ranks 0..S-1 (each rank also a worker), push/pull over torch.distributed.rpc instead of all-reduce; 0 = off"})
    ps_staleness: int = field(default=0, metadata={"help": "parameter server: 0 = bulk-synchronous (= one process); s > 0 = bounded delay, a worker may run at most s steps ahead of the slowest"})
    zeropp_quantize_weights: bool = field(default=False, metadata={"help": "ZeRO++ qwZ: zero-3 parameter all-gathers in block-quantized int8 (zero 3)"})
    zeropp_hpz: int = field(default=0, metadata={"help": "ZeRO++ hpZ: ranks per node; after forward keep a secondary parameter shard over that many consecutive dp ranks so backward gathers stay in the node (zero 3; 0 = off)"})
    gpus_per_node: int = field(default=0, metadata={"help": "ranks per node (consecutive global ranks): what the communication ledger counts as across nodes, what moe.dispatch=hierarchical crosses once and moe.max_nodes counts; 0 = the launcher's LOCAL_WORLD_SIZE (torchrun), else one node. Declare nodes on one machine to test a multi-node layout"})
    zeropp_quantize_grads: bool = field(default=False, metadata={"help": "ZeRO++ qgZ: gradient reduce-scatter as an all-to-all of block-quantized int8 (zero 2, 3)"})

    def summary(self) -> str:
        """The layout in one line (train.py's start-up line): degrees, then every setting that
        is not at its default, so a user can confirm offload / ZeRO++ / schedule are on."""
        s = (f"dp={self.dp} tp={self.tp} pp={self.pp} ep={self.ep} zero={self.zero} "
             f"precision={self.precision}")
        if self.param_dtype != "fp32":
            s += f" param_dtype={self.param_dtype}"
        if self.tp_mode != "1d":
            s += f" tp_mode={self.tp_mode}" + (f" tp_depth={self.tp_depth}" if self.tp_mode == "2.5d" else "")
        if self.cp > 1:
            s += f" cp={self.cp} cp_mode={self.cp_mode}"
        if self.etp > 1:
            s += f" etp={self.etp}"
        if self.pp > 1:
            s += f" pp_schedule={self.pp_schedule} microbatches={self.microbatches or self.pp}"
            if self.pp_layers and len(set(self.pp_layers.split(","))) > 1:
                s += f" pp_layers={self.pp_layers}"
        extras = [f"{f.name}={_toml(getattr(self, f.name))}" for f in dataclasses.fields(self)
                  if f.name in _SHOWN_IF_SET and getattr(self, f.name) != f.default]
        return " ".join([s] + extras)

    @property
    def recompute_parts(self) -> tuple:
        """parallel.recompute_modules as a tuple of names (after validate())."""
        return tuple(n for n in str(self.recompute_modules).split(",") if n)

    # ---- derived sizes (valid after validate()) ----
    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Ranks of one stage and tp position holding the same dense weights: dp x cp (the
        data-parallel group of gradient reduction and ZeRO; dp of them take distinct rows)."""
        return self.dp * self.cp

    @property
    def pool(self) -> int:
        """Ranks of one stage that route distinct tokens in MoE layers: dp x cp x tp."""
        return self.dp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Ranks holding the same expert slices (expert-data-parallel degree)."""
        return self.pool // (self.ep * self.etp)

    @property
    def tp_grid(self) -> int:
        """q, the side of the 2-D tensor-parallel grid (tp = q*q*tp_depth); 0 under 1d."""
        if self.tp_mode == "1d":
            return 0
        return round((self.tp // self.tp_depth) ** 0.5)

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank > 0:
            return self.pp_stages_per_rank
        return 2 if self.pp_schedule in MULTI_STAGE_SCHEDULES and self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stages_of(self, pp_rank: int) -> list:
        """The pipeline stages rank `pp_rank` runs (pipeline/schedules.py placements)."""
        return stage_ids(self.pp_schedule, self.pp, self.stages_per_rank, pp_rank)

    def validate(self, world_size: int, model_cfg=None, moe_cfg=None, batch_size=None,
                 seq_len=None) -> "ParallelPlan":
        """Check the plan and return a copy with dp resolved (dp=-1 -> remaining ranks) and
        microbatches resolved (0 -> pp).

        model_cfg / moe_cfg (models.config dataclasses, optional) enable the divisibility checks
        of heads, d_ff, vocab, layers and experts; batch_size (global, in sequences, optional)
        enables the batch / microbatch checks; seq_len (tokens per sequence, optional) the
        sequence-parallel split under tp. Raises ValueError naming the field and the fix.
        """
        _check_choices(self)
        _check_degrees(self)
        plan = dataclasses.replace(self, dp=_resolve_dp(self, world_size),
                                   microbatches=self.microbatches or (self.pp if self.pp > 1 else 1),
                                   recompute_modules=",".join(_recompute_parts(self)))
        _check_recompute(plan)
        _check_ep(plan)
        _check_cp(plan)
        _check_tp_mode(plan)
        _check_zero_family(plan)
        _check_prefetch(plan)
        _check_ps(plan)
        _check_2bw(plan)
        if _has_moe(moe_cfg):
            _check_replicas(plan, moe_cfg)
            _check_overlap(plan, moe_cfg)
            _check_a2a_overlap(plan, moe_cfg)
            _check_dispatch_dtype(plan, moe_cfg)
            _check_nodes(plan, moe_cfg)
        _check_fp8(plan, model_cfg, moe_cfg)
        if model_cfg is not None:
            _check_model(plan, model_cfg, moe_cfg)
            if plan.pp > 1 and getattr(model_cfg, "n_layers", None) is not None:
                plan = dataclasses.replace(plan, pp_layers=_stage_layers(plan, model_cfg, moe_cfg, seq_len))
        if batch_size is not None:
            _check_batch(plan, batch_size, _has_moe(moe_cfg), _routes_whole_sequences(moe_cfg))
        if seq_len is not None and plan.tp_mode == "1d":
            check_seq_len(seq_len, plan.tp, "data.seq_len")
            check_cp_seq_len(seq_len, plan.cp, plan.tp, "data.seq_len")
        return plan


def _err(msg: str) -> ValueError:
    return ValueError(msg)


def _check_choices(p: ParallelPlan) -> None:
    for name, value, choices in (("pp_schedule", p.pp_schedule, PP_SCHEDULES),
                                 ("precision", p.precision, PRECISIONS),
                                 ("tp_mode", p.tp_mode, TP_MODES),
                                 ("recompute", p.recompute, RECOMPUTE),
                                 ("cp_mode", p.cp_mode, CP_MODES)):
        if value not in choices:
            raise _err(f"parallel.{name}={value!r} is not supported; use one of {', '.join(choices)}")
    if p.zero not in (0, 1, 2, 3) or isinstance(p.zero, bool):
        raise _err(f"parallel.zero={p.zero!r} must be 0, 1, 2 or 3")
    if not isinstance(p.compile, bool):
        raise _err(f"parallel.compile={p.compile!r} must be true or false")
    if p.fp8_recipe not in FP8_RECIPES:
        raise _err(f"parallel.fp8_recipe={p.fp8_recipe!r} is not supported; use one of "
                   f"{', '.join(FP8_RECIPES)}")
    if p.fp8_recipe != "tensorwise" and p.precision != "fp8":
        raise _err(f"parallel.fp8_recipe={p.fp8_recipe} needs parallel.precision=fp8 (got "
                   f"{p.precision}); set precision=fp8 or drop fp8_recipe")
    if p.precision == "fp16" and isinstance(p.pp, int) and p.pp > 1:
        raise _err(f"parallel.precision='fp16' is not supported with parallel.pp={p.pp} (the loss "
                   f"scale would have to reach every stage's aux losses); use precision='bf16', "
                   f"which needs no loss scaling")


def _recompute_parts(p: ParallelPlan) -> list:
    v = p.recompute_modules
    names = v if isinstance(v, (list, tuple)) else str(v).split(",")
    out = []
    for n in names:
        n = str(n).strip()
        if n and n not in RECOMPUTE_MODULES:
            raise _err(f"parallel.recompute_modules names {n!r}; use any of {', '.join(RECOMPUTE_MODULES)}")
        if n and n not in out:
            out.append(n)
    return out


def _check_recompute(p: ParallelPlan) -> None:
    parts = p.recompute_parts
    if p.recompute == "selective" and not parts:
        raise _err("parallel.recompute=selective needs parallel.recompute_modules, e.g. "
                   "parallel.recompute_modules=layernorm,moe_act")
    if p.recompute != "selective" and parts:
        raise _err(f"parallel.recompute_modules={p.recompute_modules} is read by "
                   f"parallel.recompute=selective only (got recompute={p.recompute}); set "
                   f"recompute=selective or recompute_modules=''")
    if "layernorm" in parts and p.tp > 1:
        raise _err(f"parallel.recompute_modules=layernorm with parallel.tp={p.tp}: the norms' "
                   f"outputs are gathered over tp before the layers reading them keep them, so "
                   f"nothing would be freed; drop layernorm or set tp=1")
    if "core_attn" in parts and p.cp > 1:
        raise _err(f"parallel.recompute_modules=core_attn with parallel.cp={p.cp}: the context-"
                   f"parallel attention core exchanges keys and values, which recomputing would "
                   f"repeat; drop core_attn or set cp=1")


def _check_recompute_model(p: ParallelPlan, m, moe_cfg) -> None:
    """A part the model does not have would be a setting that does nothing: refused."""
    moe, dense = _has_moe(moe_cfg), _has_dense_ffn(moe_cfg)
    missing = {"mla_up_proj": getattr(m, "attention", "mha") != "mla",
               "mlp": not dense, "moe_act": not moe, "experts": not moe,
               "shared_experts": not moe or not getattr(moe_cfg, "num_shared_experts", 0)}
    for part in p.recompute_parts:
        if missing.get(part):
            what = {"mla_up_proj": "model.attention='mla'", "mlp": "a block without MoE",
                    "shared_experts": "moe.num_shared_experts > 0"}.get(part, "MoE blocks")
            raise _err(f"parallel.recompute_modules={part}: the model has no {part} (needs {what}); "
                       f"drop it from parallel.recompute_modules")


def _check_degrees(p: ParallelPlan) -> None:
    for name in ("tp", "pp", "cp", "ep", "etp"):
        v = getattr(p, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _err(f"parallel.{name}={v!r} must be an integer >= 1")
    mb = p.microbatches
    if not isinstance(mb, int) or isinstance(mb, bool) or mb < 0:
        raise _err(f"parallel.microbatches={mb!r} must be 0 (auto: one per pipeline stage) or an "
                   f"integer >= 1")
    if not isinstance(p.dp, int) or isinstance(p.dp, bool) or not (p.dp == -1 or p.dp >= 1):
        raise _err(f"parallel.dp={p.dp!r} must be -1 (all remaining ranks) or an integer >= 1")
    if not isinstance(p.pp_stages_per_rank, int) or p.pp_stages_per_rank < 0:
        raise _err(f"parallel.pp_stages_per_rank={p.pp_stages_per_rank!r} must be 0 (auto) or >= 1")
    parse_layers(p.pp_layers)  # its form; counts are checked against the model below
    if p.pp == 1 and str(p.pp_layers).strip() not in ("", "even"):
        raise _err(f"parallel.pp_layers={p.pp_layers!r} needs parallel.pp > 1; remove it")
    if p.pp == 1 and p.pp_stages_per_rank > 1:
        raise _err(f"parallel.pp_stages_per_rank={p.pp_stages_per_rank} needs parallel.pp > 1; "
                   f"set pp_stages_per_rank=0")
    if p.pp_schedule in V_SCHEDULES and p.pp_stages_per_rank not in (0, 2):
        raise _err(f"parallel.pp_schedule={p.pp_schedule} places exactly 2 stages per rank (a V: "
                   f"stages r and 2*pp-1-r); set parallel.pp_stages_per_rank=0 or 2")
    if p.pp_schedule not in MULTI_STAGE_SCHEDULES and p.pp_stages_per_rank > 1:
        raise _err(f"parallel.pp_stages_per_rank={p.pp_stages_per_rank} needs a multi-stage schedule, "
                   f"parallel.pp_schedule=interleaved_1f1b or zb_interleaved (gpipe/1f1b run one "
                   f"stage per rank)")


def check_seq_len(seq_len: int, tp: int, where: str) -> None:
    """Sequence parallelism splits every sequence into tp equal parts between blocks."""
    if tp > 1 and seq_len % tp:
        lower, upper = seq_len - seq_len % tp, seq_len - seq_len % tp + tp
        raise _err(f"{where}={seq_len} is not divisible by parallel.tp={tp} (sequence parallelism "
                   f"splits each sequence into tp equal parts); use a multiple of {tp}, e.g. "
                   f"{lower or upper} or {upper}")


def _resolve_dp(p: ParallelPlan, world_size: int) -> int:
    if not isinstance(world_size, int) or world_size < 1:
        raise _err(f"world_size={world_size!r} must be a positive integer")
    rest = p.tp * p.pp * p.cp
    names = "tp*pp" + ("*cp" if p.cp > 1 else "")
    degrees = f"{p.tp}*{p.pp}" + (f"*{p.cp}" if p.cp > 1 else "")
    if p.dp == -1:
        if world_size % rest:
            raise _err(f"parallel.{names} = {degrees} = {rest} does not divide the world size "
                       f"{world_size}; start a multiple of {rest} processes, or choose {names.replace('*', ', ')} "
                       f"whose product divides {world_size} ({_fitting(p, world_size)})")
        return world_size // rest
    if p.dp * rest != world_size:
        start = f"start {p.dp * rest} processes (torchrun --nproc-per-node {p.dp * rest})"
        if world_size % rest:  # dp=-1 alone would fail next: name the whole fix at once
            fix = (f"set parallel.dp=-1 together with {_fitting(p, world_size)} (dp=-1 alone is not "
                   f"enough: {names} = {rest} does not divide {world_size})")
        else:
            fix = f"set parallel.dp=-1 (= {world_size // rest} here, the ranks left after {names})"
        raise _err(f"parallel.dp*{names} = {p.dp}*{degrees} = {p.dp * rest} but the world size is "
                   f"{world_size}; {start}, or {fix}")
    return p.dp


def _fitting(p: ParallelPlan, world_size: int) -> str:
    """The largest tp, pp (and cp) not above the plan's whose product divides the world size
    (pp and cp are lowered first: tensor parallelism is kept where it fits)."""
    fits = [(t, q, c) for t in range(1, p.tp + 1) for q in range(1, p.pp + 1)
            for c in range(1, p.cp + 1) if world_size % (t * q * c) == 0] or [(1, 1, 1)]
    t, q, c = max(fits, key=lambda f: (f[0] * f[1] * f[2], f[0], f[2]))
    return f"parallel.tp={t} parallel.pp={q}" + (f" parallel.cp={c}" if p.cp > 1 else "")


def _check_ep(p: ParallelPlan) -> None:
    pool = "dp*cp*tp" if p.cp > 1 else "dp*tp"
    sizes = f"{p.dp}*{p.cp}*{p.tp}" if p.cp > 1 else f"{p.dp}*{p.tp}"
    if p.pool % p.ep:
        raise _err(f"parallel.ep={p.ep} must divide {pool} = {sizes} = {p.pool} (experts "
                   f"are spread over the ranks of one pipeline stage); lower ep or raise dp")
    if p.pool % (p.ep * p.etp):
        raise _err(f"parallel.ep*etp = {p.ep}*{p.etp} must divide {pool} = {sizes} = "
                   f"{p.pool} (each expert's d_ff is split over etp of one stage's ranks); "
                   f"lower etp or raise dp")


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


def _check_2bw(p: ParallelPlan) -> None:
    """PipeDream-2BW runs its own schedule (parallel/pipeline/twobw.py) over one stage per rank and
    applies the optimizer to whole, untied, fp32 stage weights; what it does not serve is refused."""
    if p.pp_schedule != "2bw" or p.pp == 1:
        return
    fix = "or use parallel.pp_schedule=1f1b"
    for bad, what in ((p.microbatches < p.pp, f"parallel.microbatches={p.microbatches} < parallel.pp="
                       f"{p.pp}: a step's gradient is complete only m >= pp micro-batches later; raise "
                       f"microbatches to {p.pp} or more"),
                      (p.tp > 1, f"parallel.tp={p.tp}: set tp=1"),
                      (p.ep > 1 or p.etp > 1, "parallel.ep/etp > 1: set ep=1 and etp=1"),
                      (p.zero > 0, f"parallel.zero={p.zero}: the stashed weight versions are whole "
                       f"parameters; set zero=0"),
                      (p.stages_per_rank > 1, "parallel.pp_stages_per_rank > 1: 2bw runs one stage per "
                       "rank; set pp_stages_per_rank=0"),
                      (p.recompute != "none", f"parallel.recompute={p.recompute}: set recompute=none"),
                      (p.precision != "fp32", f"parallel.precision={p.precision}: set precision=fp32"),
                      (p.compile, "parallel.compile=true: set compile=false")):
        if bad:
            raise _err(f"parallel.pp_schedule=2bw with {what} ({fix})")


def _check_param_dtype(p: ParallelPlan) -> None:
    """bf16 parameters need somewhere to keep the fp32 masters: ZeRO-1/2's slices."""
    if p.param_dtype not in PARAM_DTYPES:
        raise _err(f"parallel.param_dtype={p.param_dtype!r} is not supported; use one of "
                   f"{', '.join(PARAM_DTYPES)}")
    if p.param_dtype == "fp32":
        return
    for bad, fix in ((p.zero == 0, "parallel.zero=0: set parallel.zero=1, 2 or 3 (the fp32 masters "
                      "live in ZeRO-1/2's slices or are ZeRO-3's shards; zero=1 works with dp=1)"),
                     (p.zero == 3 and p.offload != "none", f"parallel.offload={p.offload!r} under "
                      f"ZeRO-3: set offload='none' (or parallel.zero=1/2 with offload='optimizer')"),
                     (p.precision != "bf16", f"parallel.precision={p.precision}: set precision=bf16 "
                      f"(autocast runs the bf16 weights' matmuls; fp16 would need loss scaling)"),
                     (p.ps_servers > 0, f"parallel.ps_servers={p.ps_servers}: set ps_servers=0 "
                      f"(the servers keep their own fp32 copies)"),
                     (p.pp > 1 and p.pp_schedule == "2bw", "parallel.pp_schedule=2bw: use another "
                      "schedule (2bw keeps its own weight versions)"),
                     (p.tp > 1 and p.zero in (1, 2), f"parallel.tp={p.tp} under ZeRO-{p.zero}: "
                      f"casting tensor-parallel weights (DTensors) to bf16 beside their fp32 "
                      f"slices is not implemented (their local blocks stayed fp32 and the first "
                      f"forward failed); set parallel.param_dtype=fp32 or parallel.tp=1")):
        if bad:
            raise _err(f"parallel.param_dtype={p.param_dtype} with {fix}")


def _check_zero_family(p: ParallelPlan) -> None:
    """offload and the ZeRO++ flags: each names the stage it needs."""
    if p.offload not in OFFLOADS:
        raise _err(f"parallel.offload={p.offload!r} is not supported; use one of {', '.join(OFFLOADS)}")
    if p.offload == "optimizer" and p.zero == 0:
        raise _err("parallel.offload='optimizer' needs a ZeRO optimizer to offload; set "
                   "parallel.zero=1, 2 or 3 (or offload='none')")
    if p.offload == "params" and p.zero != 3:
        raise _err(f"parallel.offload='params' offloads sharded parameters, which exist under ZeRO-3 "
                   f"only (got zero={p.zero}); set parallel.zero=3, or offload='optimizer'")
    for name in ("zeropp_quantize_weights", "zeropp_quantize_grads"):
        if not isinstance(getattr(p, name), bool):
            raise _err(f"parallel.{name}={getattr(p, name)!r} must be true or false")
    if p.zeropp_quantize_weights and p.zero != 3:
        raise _err(f"parallel.zeropp_quantize_weights=true quantizes ZeRO-3 parameter gathers "
                   f"(got zero={p.zero}); set parallel.zero=3 or zeropp_quantize_weights=false")
    if p.zeropp_quantize_grads and p.zero not in (2, 3):
        raise _err(f"parallel.zeropp_quantize_grads=true quantizes the gradient reduce-scatter of "
                   f"ZeRO-2/3 (got zero={p.zero}); set parallel.zero=2 or 3")
    _check_hpz(p)
    _check_param_dtype(p)
    if p.zero == 3 and p.pp > 1 and p.pp_schedule in ZERO_BUBBLE:
        raise _err(f"parallel.pp_schedule={p.pp_schedule} with parallel.zero=3: the zero-bubble "
                   f"schedules compute weight gradients after FSDP2 has reduce-scattered the "
                   f"stage's gradients, so those are lost (measured); use parallel.zero=1 or 2, or "
                   f"pp_schedule=1f1b / interleaved_1f1b with zero 3")


def _check_ps(p: ParallelPlan) -> None:
    S, s = p.ps_servers, p.ps_staleness
    for name, v in (("ps_servers", S), ("ps_staleness", s)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise _err(f"parallel.{name}={v!r} must be an integer >= 0")
    if s and not S:
        raise _err(f"parallel.ps_staleness={s} needs the parameter-server layout; set "
                   f"parallel.ps_servers >= 1 or ps_staleness=0")
    if not S:
        return
    if S > p.world:
        raise _err(f"parallel.ps_servers={S} exceeds the {p.world} ranks (every server shard "
                   f"lives on a rank that is also a worker); use at most {p.world}")
    for name, value, ok in (("tp", p.tp, 1), ("pp", p.pp, 1), ("ep", p.ep, 1), ("etp", p.etp, 1),
                            ("zero", p.zero, 0)):
        if value != ok:
            raise _err(f"parallel.ps_servers={S} with parallel.{name}={value}: the parameter "
                       f"server replaces data-parallel all-reduce and keeps whole replicas on "
                       f"the workers; set parallel.{name}={ok} or ps_servers=0")
    for bad, fix in ((p.offload != "none", "parallel.offload=none (the servers already hold the "
                      "optimizer in host memory)"),
                     (p.precision == "fp16", "parallel.precision=fp32 or bf16 (fp16 loss scaling "
                      "needs every rank to agree on overflow each step)"),
                     (p.compile, "parallel.compile=false")):
        if bad:
            raise _err(f"parallel.ps_servers={S}: not served with this setting; set {fix}")


def _check_prefetch(p: ParallelPlan) -> None:
    n = p.zero_prefetch
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise _err(f"parallel.zero_prefetch={n!r} must be an integer >= 0 (0 = FSDP2's default)")
    if n and p.zero != 3:
        raise _err(f"parallel.zero_prefetch={n} prefetches ZeRO-3 parameter all-gathers (got "
                   f"zero={p.zero}); set parallel.zero=3 or zero_prefetch=0")


def _check_hpz(p: ParallelPlan) -> None:
    h = p.zeropp_hpz
    if not isinstance(h, int) or isinstance(h, bool) or h < 0:
        raise _err(f"parallel.zeropp_hpz={h!r} must be 0 (off) or the number of ranks per node")
    if h == 0:
        return
    if p.zero != 3:
        raise _err(f"parallel.zeropp_hpz={h} keeps a secondary ZeRO-3 parameter shard (got "
                   f"zero={p.zero}); set parallel.zero=3 or zeropp_hpz=0")
    if h >= p.dp or p.dp % h:
        raise _err(f"parallel.zeropp_hpz={h} must divide parallel.dp={p.dp} and be smaller than it "
                   f"(a node of {h} ranks inside the dp group); use a divisor of {p.dp} below it, or 0")


def _routes_whole_sequences(moe_cfg) -> bool:
    """MoE layers that must be handed whole sequences (moe.config.routes_per_sequence)."""
    return _has_moe(moe_cfg) and routes_per_sequence(
        getattr(moe_cfg, "router", "token_choice"), getattr(moe_cfg, "capacity_factor", None),
        getattr(moe_cfg, "eval_capacity_factor", "same"))


def _has_moe(moe_cfg) -> bool:
    return moe_cfg is not None and getattr(moe_cfg, "every", 1) != 0 and \
        getattr(moe_cfg, "num_experts", 0) > 0


def _has_dense_ffn(moe_cfg) -> bool:
    """Whether some block keeps a dense FFN (moe_cfg None: a dense model, or not known)."""
    return not _has_moe(moe_cfg) or moe_cfg.every != 1 or getattr(moe_cfg, "first_moe_layer", 0) > 0


def _check_replicas(p: ParallelPlan, moe_cfg) -> None:
    R, E = getattr(moe_cfg, "replica_slots", 0), moe_cfg.num_experts
    if R and p.ep == 1:
        raise _err(f"moe.replica_slots={R} replicates hot experts across expert-parallel ranks, "
                   f"but parallel.ep=1; set parallel.ep > 1 or moe.replica_slots=0")
    if R and p.etp > 1:
        raise _err(f"moe.replica_slots={R} with parallel.etp={p.etp}: replica placement is decided "
                   f"per expert-parallel group and would differ between the ranks that split an "
                   f"expert; set moe.replica_slots=0 or parallel.etp=1")
    if p.ep > 1 and E % p.ep == 0 and R > E - E // p.ep:
        raise _err(f"moe.replica_slots={R} exceeds the {E - E // p.ep} experts an ep rank does "
                   f"not own (moe.num_experts={E}, parallel.ep={p.ep}); use at most {E - E // p.ep}")


def _check_dispatch_dtype(p: ParallelPlan, moe_cfg) -> None:
    if getattr(moe_cfg, "dispatch_dtype", "auto") == "fp8" and p.precision == "fp16":
        raise _err("moe.dispatch_dtype=fp8 sends the gradients and the combine in bf16, which "
                   "parallel.precision=fp16's loss scaling does not expect; use precision=bf16 "
                   "(or fp32), or moe.dispatch_dtype=auto")


def ep_group_of(p: ParallelPlan, rank: int) -> list:
    """The global ranks of `rank`'s expert-parallel group (mesh.py's rank order: pp
    outermost, a stage's pool as (edp, ep, etp), etp innermost; tests/unit check it against
    mesh.rank_groups)."""
    stage, pos = divmod(rank, p.pool)
    e, t = pos // (p.ep * p.etp), pos % p.etp
    return [stage * p.pool + (e * p.ep + i) * p.etp + t for i in range(p.ep)]


def ep_group_ranks(p: ParallelPlan) -> list:
    """Every expert-parallel group's global ranks."""
    return [ep_group_of(p, stage * p.pool + e * p.ep * p.etp + t)
            for stage in range(p.pp) for e in range(p.edp) for t in range(p.etp)]


def _check_nodes(p: ParallelPlan, moe_cfg) -> None:
    g, mode, M = p.gpus_per_node, getattr(moe_cfg, "dispatch", "flat"), getattr(moe_cfg, "max_nodes", 0)
    if isinstance(g, bool) or not isinstance(g, int) or g < 0:
        raise _err(f"parallel.gpus_per_node={g!r} must be an integer >= 0 (0 = the launcher's "
                   f"local world size)")
    if g and p.world % g:
        raise _err(f"parallel.gpus_per_node={g} does not divide the {p.world} ranks into whole "
                   f"nodes; use a divisor of the world size")
    for field_, on in (("dispatch=hierarchical", mode == "hierarchical"), (f"max_nodes={M}", M)):
        if on and p.ep == 1:
            raise _err(f"moe.{field_} works on the nodes of the expert-parallel group, but "
                       f"parallel.ep=1; set parallel.ep > 1 or leave moe.{field_.split('=')[0]} "
                       f"at its default")
    if mode == "hierarchical" and getattr(moe_cfg, "a2a_overlap_degree", 1) > 1:
        raise _err(f"moe.dispatch=hierarchical with moe.a2a_overlap_degree="
                   f"{moe_cfg.a2a_overlap_degree}: the chunked overlap runs the flat exchange; "
                   f"set moe.a2a_overlap_degree=1 or moe.dispatch=flat")
    if M and getattr(moe_cfg, "replica_slots", 0):
        raise _err(f"moe.max_nodes={M} with moe.replica_slots={moe_cfg.replica_slots}: a replica "
                   f"may sit on another node than its expert, so the nodes a token reaches are "
                   f"not its experts' nodes; set one of them to 0")
    if g and p.ep > 1 and (mode == "hierarchical" or M):
        from moe.nodes import expert_nodes
        # the same number of ep ranks on every node; groups may span different node counts
        spans = {expert_nodes(ranks, g).num_nodes for ranks in ep_group_ranks(p)}
        if M and len(spans) > 1:  # the routing would differ between expert-data-parallel copies
            raise _err(f"moe.max_nodes={M}: the expert-parallel groups span {sorted(spans)} nodes of "
                       f"parallel.gpus_per_node={g} ranks, so tokens would be routed differently "
                       f"on different groups; choose gpus_per_node so that every ep group spans "
                       f"the same number of nodes (e.g. a multiple of ep*etp or a divisor of it)")
        for n in sorted(spans) if M else ():
            _check_node_routing(moe_cfg, n)


def _check_node_routing(moe_cfg, n: int) -> None:
    """max_nodes against the experts' n nodes: the router's own check, before any collective."""
    from moe.config import RoutingConfig
    try:
        RoutingConfig(num_experts=moe_cfg.num_experts, top_k=moe_cfg.top_k,
                      n_group=moe_cfg.n_group, topk_group=moe_cfg.topk_group or None,
                      max_nodes=moe_cfg.max_nodes, expert_nodes=n)
    except ValueError as e:
        raise _err(f"moe.{e} (the experts span {n} nodes of parallel.gpus_per_node ranks)") from None


def _check_a2a_overlap(p: ParallelPlan, moe_cfg) -> None:
    if p.a2a_overlap not in A2A_OVERLAPS:
        raise _err(f"parallel.a2a_overlap={p.a2a_overlap!r} is not supported; use one of {A2A_OVERLAPS}")
    if p.a2a_overlap == "none":
        return
    unpaired = p.pp > 1 and p.pp_schedule == "gpipe"  # (2bw refuses ep > 1 itself)
    # a pair's forward ends after the backward's interleaved pieces, and in the 1F1B family
    # the next stage waits for that output: simulated 1.05-1.4x the plain step until the
    # exchanges are as long as the compute (parallel/pipeline/simulate.py); the V schedules'
    # pairs gain from a quarter of it
    delayed = p.pp > 1 and p.pp_schedule in ("1f1b", "interleaved_1f1b", "zb_interleaved")
    for bad, why in ((p.ep == 1, "parallel.ep=1 has no expert all-to-all to hide; set parallel.ep > 1"),
                     (unpaired, f"parallel.pp_schedule={p.pp_schedule} never runs a forward next to a "
                                f"backward of another micro-batch; use zbv or dualpipev"),
                     (delayed, f"inside parallel.pp_schedule={p.pp_schedule} each pair's forward output "
                               f"leaves after the backward's interleaved pieces and the next stage "
                               f"waits for it (simulated 1.05-1.4x the plain step); use "
                               f"parallel.pp_schedule=zbv or dualpipev, or moe.a2a_overlap_degree > 1"),
                     (p.ps_servers > 0, "the parameter server runs one micro-batch at a time; set "
                                        "parallel.ps_servers=0"),
                     (getattr(moe_cfg, "a2a_overlap_degree", 1) > 1,
                      "moe.a2a_overlap_degree > 1 waits for its own chunks; use one of the two overlaps")):
        if bad:
            raise _err(f"parallel.a2a_overlap={p.a2a_overlap}: {why} (or parallel.a2a_overlap=none)")


def _check_overlap(p: ParallelPlan, moe_cfg) -> None:
    d = getattr(moe_cfg, "a2a_overlap_degree", 1)
    if d > 1 and p.ep == 1:
        raise _err(f"moe.a2a_overlap_degree={d} overlaps the expert-parallel all-to-all, but "
                   f"parallel.ep=1 has none; set parallel.ep > 1 or moe.a2a_overlap_degree=1")


def _check_model(p: ParallelPlan, m, moe_cfg) -> None:
    arch = getattr(m, "arch", "gpt")
    if arch != "gpt" and (p.tp > 1 or p.pp > 1):
        raise _err(f"parallel.tp/pp > 1 is implemented for model.arch='gpt' only (got {arch!r}); "
                   f"use data/expert parallelism and ZeRO for it (tp=1, pp=1)")
    if p.tp > 1 and p.tp_mode == "1d":
        for name in ("n_heads", "d_ff", "vocab_size"):
            v = getattr(m, name, None)
            if v is not None and v % p.tp:
                raise _err(f"model.{name}={v} is not divisible by parallel.tp={p.tp}; pick a tp that "
                           f"divides it (or change model.{name})")
    if p.tp > 1:
        _check_tp_attention(p, m)
    if p.tp_mode != "1d":
        _check_grid_model(p, m, moe_cfg)
    if p.cp > 1:
        _check_cp_model(p, m, moe_cfg)
    if p.pp > 1 and p.pp_schedule == "2bw" and getattr(m, "tie_embeddings", False):
        raise _err("parallel.pp_schedule=2bw with model.tie_embeddings=true: the first and last "
                   "stage would update one weight from two stashed versions; set "
                   "model.tie_embeddings=false (or use parallel.pp_schedule=1f1b)")
    if p.pp > 1 and p.pp_schedule in V_SCHEDULES and getattr(m, "tie_embeddings", False):
        raise _err(f"parallel.pp_schedule={p.pp_schedule} with model.tie_embeddings=true: the V puts "
                   f"both ends of the pipeline on rank 0, where torch 2.13's zero-bubble weight pass "
                   f"gets the shared weight's gradient wrong (measured); set "
                   f"model.tie_embeddings=false or use pp_schedule=zb_interleaved")
    if _has_moe(moe_cfg) and moe_cfg.num_experts % p.ep:
        raise _err(f"moe.num_experts={moe_cfg.num_experts} is not divisible by parallel.ep={p.ep}; "
                   f"pick an ep that divides it")
    if not _has_moe(moe_cfg) and p.ep > 1 and moe_cfg is not None:
        raise _err(f"parallel.ep={p.ep} needs MoE layers (moe.every=0 makes a dense model); set ep=1")
    if p.etp > 1:
        _check_etp_model(p, m, moe_cfg)
    _check_recompute_model(p, m, moe_cfg)


def _check_fp8(p: ParallelPlan, m, moe_cfg) -> None:
    """precision=fp8 (parallel/fp8.py): what it does not compose with yet, and the dims its
    128 x 128 weight blocks must tile (m, moe_cfg: None = not known here)."""
    if p.precision != "fp8":
        return
    for bad, what in ((p.tp > 1 and p.tp_mode != "1d", f"parallel.tp_mode={p.tp_mode}: the "
                       f"grid's SUMMA forwards run their own matmuls, not the FP8 ones; use "
                       f"tp_mode=1d"),
                      (p.param_dtype != "fp32", f"parallel.param_dtype={p.param_dtype}: the FP8 "
                       f"casts read fp32 masters; set param_dtype=fp32")):
        if bad:
            raise _err(f"parallel.precision=fp8 with {what} (or use precision=bf16)")
    dims = [("model.d_model", getattr(m, "d_model", None))]
    if moe_cfg is not None and _has_moe(moe_cfg) and getattr(moe_cfg, "d_ff", 0):
        dims.append(("moe.d_ff", moe_cfg.d_ff))
    dims.append(("model.d_ff", getattr(m, "d_ff", None)))
    for name, v in dims:
        if isinstance(v, int) and v % 128:
            raise _err(f"parallel.precision=fp8 needs {name} to be a multiple of 128 (got {v}: "
                       f"the expert GEMMs' 128 x 128 weight blocks); change {name} or use "
                       f"precision=bf16")
    d_ff = getattr(m, "d_ff", None)
    if p.tp > 1 and _has_dense_ffn(moe_cfg) and isinstance(d_ff, int) and d_ff % (128 * p.tp):
        raise _err(f"parallel.precision=fp8 with parallel.tp={p.tp} needs model.d_ff to be a "
                   f"multiple of 128 x tp = {128 * p.tp} (got {d_ff}: the dense FFN's d_ff is "
                   f"split tp ways and each slice must hold whole 128 x 128 blocks); change it "
                   f"or tp")
    expert_ff = (getattr(moe_cfg, "d_ff", 0) or getattr(m, "d_ff", 0)) if moe_cfg is not None else 0
    if p.etp > 1 and isinstance(expert_ff, int) and expert_ff % (128 * p.etp):
        raise _err(f"parallel.precision=fp8 with parallel.etp={p.etp} needs the experts' d_ff "
                   f"(moe.d_ff, or model.d_ff where it is 0) to be a multiple of 128 x etp = "
                   f"{128 * p.etp} (got {expert_ff}: each rank's slice must hold whole 128 x 128 "
                   f"blocks); change it or etp")


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


def _stage_layers(p: ParallelPlan, m, moe_cfg, seq_len) -> str:
    """parallel.pp_layers resolved to its explicit form (pipeline/layers.py)."""
    try:
        return resolve_layers(p.pp_layers, p.num_stages, m, moe_cfg if _has_moe(moe_cfg) else None,
                              seq_len)
    except ValueError as e:
        raise _err(f"{e} (parallel.pp={p.pp} x {p.stages_per_rank} stage(s) per rank)") from None


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


def _check_etp_model(p: ParallelPlan, m, moe_cfg) -> None:
    """Expert tensor parallelism splits the routed experts' d_ff (moe/expert_tp.py)."""
    if moe_cfg is not None and not _has_moe(moe_cfg):
        raise _err(f"parallel.etp={p.etp} splits routed experts, and moe.every=0 makes a dense "
                   f"model; set etp=1")
    if moe_cfg is None:
        return
    d_ff = getattr(moe_cfg, "d_ff", 0) or getattr(m, "d_ff", 0)
    if d_ff % p.etp:
        raise _err(f"the experts' d_ff={d_ff} (moe.d_ff, else model.d_ff) is not divisible by "
                   f"parallel.etp={p.etp}; pick an etp that divides it")
    if getattr(m, "bias", False) and getattr(m, "arch", "gpt") == "gpt":
        raise _err(f"parallel.etp={p.etp} with model.bias=true: the experts' output bias is added "
                   f"once per row, not per d_ff slice; set model.bias=false or parallel.etp=1")


def _check_batch(p: ParallelPlan, batch_size: int, has_moe: bool, whole_sequences: bool) -> None:
    if batch_size % p.dp:
        raise _err(f"train.batch_size={batch_size} (global, in sequences) is not divisible by "
                   f"parallel.dp={p.dp}; use a multiple of {p.dp}")
    local = batch_size // p.dp
    mb = p.microbatches if p.pp > 1 else 1
    if p.pp > 1 and local % mb:
        raise _err(f"per-rank batch {local} (train.batch_size/dp) is not divisible by "
                   f"parallel.microbatches={mb}; pick microbatches dividing {local}")
    if p.pp > 1 and p.pp_schedule != "gpipe" and mb < p.pp:
        raise _err(f"parallel.microbatches={mb} is less than parallel.pp={p.pp}: schedule "
                   f"{p.pp_schedule} needs at least one microbatch per stage; raise microbatches")
    if p.pp > 1 and p.pp_schedule == "dualpipev" and mb < p.num_stages:
        raise _err(f"parallel.microbatches={mb}: pp_schedule dualpipev needs at least one microbatch "
                   f"per stage ({p.num_stages} = 2 x parallel.pp={p.pp}); raise microbatches to "
                   f"{p.num_stages} or more")
    rounds = max(1, mb // p.pp)
    if p.pp > 1 and p.pp_schedule == "zb_interleaved" and mb % rounds:
        raise _err(f"parallel.microbatches={mb}: pp_schedule zb_interleaved runs rounds of "
                   f"parallel.pp={p.pp} microbatches ({rounds} here) and needs a multiple of them; "
                   f"use a multiple of {p.pp}")
    rows = p.tp_depth * p.tp_grid
    if p.tp_mode != "1d" and (local // mb) % rows:
        raise _err(f"microbatch size {local // mb} sequences is not divisible by {rows} (parallel."
                   f"tp_mode={p.tp_mode} splits the batch over tp_depth x q = {p.tp_depth} x "
                   f"{p.tp_grid} grid rows); raise train.batch_size or lower parallel.microbatches")
    if p.tp > 1 and p.tp_mode != "1d" and has_moe and (local // mb) % p.tp:
        raise _err(f"microbatch size {local // mb} sequences is not divisible by parallel.tp={p.tp}: "
                   f"under tp_mode={p.tp_mode} MoE layers split whole sequences across tp ranks "
                   f"so each token is routed once; raise train.batch_size or lower "
                   f"parallel.microbatches")
    if p.tp > 1 and p.tp_mode == "1d" and whole_sequences and (local // mb) % p.tp:
        raise _err(f"microbatch size {local // mb} sequences is not divisible by parallel.tp={p.tp}: "
                   f"MoE layers with a capacity or expert choice route whole sequences, split "
                   f"across tp ranks; raise train.batch_size, lower parallel.microbatches, or "
                   f"route dropless token choice (moe.capacity_factor=none), which splits "
                   f"along the sequence")
