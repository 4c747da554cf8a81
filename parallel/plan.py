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
model/MoE/batch sizes, and every error names the field and a fix. The rules live in
plan_rules/, one module per concept; validate runs them in a fixed order, which decides the
error a user sees first.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Union

from .pipeline.schedules import MULTI_STAGE_SCHEDULES, stage_ids
# what each choice field accepts (parallel/fp8.py, recompute.py and the planner import them from here)
from .plan_rules.choices import (A2A_OVERLAPS, CP_MODES, FP8_RECIPES, OFFLOADS, PARAM_DTYPES,  # noqa: F401
                                 PRECISIONS, RECOMPUTE, RECOMPUTE_MODULES, TP_MODES)
from .plan_rules.context import _check_cp, check_cp_seq_len
from .plan_rules.data_parallel import _check_prefetch, _check_ps, _check_zero_family
from .plan_rules.degrees import _check_choices, _check_degrees, _resolve_dp
from .plan_rules.experts import (_check_a2a_overlap, _check_dispatch_dtype, _check_ep, _check_nodes,
                                 _check_overlap, _check_replicas, _has_moe, _routes_whole_sequences)
from .plan_rules.experts import ep_group_of, ep_group_ranks  # noqa: F401 (the planner's and tests' import)
from .plan_rules.model import _check_batch, _check_fp8, _check_model
from .plan_rules.pipeline import _check_2bw, _stage_layers
from .plan_rules.recompute import _check_recompute, _recompute_parts
from .plan_rules.tensor import _check_tp_mode, check_seq_len


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
    precision: str = field(default="fp32", metadata={"help": "fp32 | bf16 (autocast, fp32 master weights and router) | fp16 (dynamic loss scaling) | fp8 (bf16 plus FP8 GEMMs: expert banks -- routed, shared, dense FFNs -- in DeepSeek-V3's 1x128-tile / 128x128-block scaling, or rowwise with parallel.fp8_recipe=rowwise; other Linears of the blocks through torchao float8 with parallel.fp8_recipe; embedding, head, norms and routers stay bf16/fp32; parallel/fp8.py)"})
    fp8_recipe: str = field(default="tensorwise", metadata={"help": "precision=fp8 only: tensorwise (default; torchao's one scale per tensor for the blocks' nn.Linears, the expert banks in 128x128 blocks: their kernel needs deep_gemm) | rowwise (torchao's one scale per row for the Linears; the expert banks' forward and input-gradient GEMMs on torch._scaled_grouped_mm, SM90+, with rowwise scales, their weight gradients in bf16, and on a GPU a bank projection whose shape cannot gain stays bf16: moe/fp8_rowwise.py; not with tp/etp)"})
    param_dtype: str = field(default="fp32", metadata={"help": "parameters and gradients: fp32 | bf16 (held in bf16, 2+2 bytes per parameter, with fp32 master slices and optimizer state in ZeRO-1/2; under ZeRO-3 FSDP2 gathers and reduces in bf16, its fp32 shards the masters: the ZeRO paper's mixed precision, K=12; needs zero 1-3 and precision=bf16; checkpoints keep the fp32 masters)"})
    a2a_overlap: str = field(default="none", metadata={"help": "none | 1f1b: with two or more micro-batches per step (train.micro_batch_size), run the forward of micro-batch i+1 beside the backward of micro-batch i, switching at every expert all-to-all so one's exchange flies while the other computes (Megatron's combined 1F1B, DualPipe's overlap; parallel/interleave.py); under pp > 1 the schedule's neighbouring forward/backward pairs (zbv, dualpipev; the 1F1B family is refused: its pairs delay the next stage; parallel/pipeline/paired_steps.py); same function; one micro-batch's activations plus the next one's up to its first MoE block (under pp: at least two micro-batch-chunks); needs ep > 1"})
    recompute: str = field(default="none", metadata={"help": "activation recomputation: none | full (recompute each block in backward) | selective (only the parts parallel.recompute_modules names)"})
    recompute_modules: Union[str, list] = field(default="", metadata={"help": "recompute=selective: the parts recomputed in backward, a TOML list or comma-separated: core_attn (attention core), layernorm (the norms' outputs), moe_act (the experts' activation), mlp (dense FFNs), mla_up_proj (MLA's up-projections), shared_experts, experts (the routed experts' GEMMs); parallel/recompute.py"})
    compile: bool | str = field(default="auto", metadata={"help": "torch.compile each block after parallelization, each region as one graph (parallel/compile.py): true | false | auto (on for CUDA runs of the layouts it is tested with -- dp, ep, ZeRO 0-3, precision fp32/bf16, no pp/cp/tp, no a2a_overlap, recompute or parameter server, not an HF model -- off elsewhere; the run's first lines say which)"})
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
                  if f.name in _SHOWN_IF_SET and getattr(self, f.name) != f.default
                  and f.name != "compile"] + (["compile=true"] if self.compiled else [])
        return " ".join([s] + extras)

    @property
    def compiled(self) -> bool:
        """parallel.compile resolved on; "auto" unresolved counts as off (train.py resolves it
        per device, parallel/compile.auto_compile; the planner's check as a CUDA run would)."""
        return self.compile is True

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
        if self.compile == "auto":  # a plan without a device compiles nothing; the trainer
            self = dataclasses.replace(self, compile=False)  # resolves auto for its device first
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
