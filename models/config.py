"""Model and MoE configuration: one dataclass per concern, laptop-CPU defaults.

Every field carries its one-line help in `dataclasses.field(metadata={"help": ...})`, so a
config system can list it (`field_help(ModelConfig)`). `validate()` raises ValueError naming
`model.<field>` / `moe.<field>` and how to fix it. Validation may normalise spellings in
place (e.g. capacity_factor 0 or "none" -> None), which is why it mutates self.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

from moe.capacity import parse_capacity_factor
from moe.config import BALANCE_LOSSES
from moe.grouped_mm import EXPERT_IMPLS
from moe.config import ROUTER_KINDS as ROUTERS
from moe.scoring import SCORE_FUNCS
from moe.layer import DISPATCH_MODES
from moe.wire import DISPATCH_DTYPES

ARCHS = ("gpt", "switch")
ATTENTIONS = ("mha", "mla")
POSITIONS = ("rope", "learned")
NORMS = ("rmsnorm", "layernorm")


def help_field(default, text: str):
    """A dataclass field with its one-line help (listed by --help); the one helper for it."""
    return field(default=default, metadata={"help": text})


_help = help_field


def field_help(cls) -> dict:
    """{field name: one-line help} for a config dataclass (class or instance)."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def _positive_int(cfg, section: str, names) -> None:
    for n in names:
        v = getattr(cfg, n)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{section}.{n}={v!r} must be a positive integer")


def _choice(cfg, section: str, name: str, choices) -> None:
    v = getattr(cfg, name)
    if v not in choices:
        raise ValueError(f"{section}.{name}={v!r} is not supported; use one of {list(choices)}")


@dataclass
class ModelConfig:
    arch: str = _help("gpt", "model family: 'gpt' (decoder-only) or 'switch' (T5-like encoder-decoder)")
    vocab_size: int = _help(256, "vocabulary size (switch: must include the span-corruption sentinel ids)")
    d_model: int = _help(128, "hidden size of the residual stream")
    n_layers: int = _help(4, "number of transformer blocks (switch: per stack, encoder and decoder each)")
    n_heads: int = _help(4, "attention heads; must divide d_model")
    d_ff: int = _help(512, "hidden size of dense FFNs and of each expert")
    max_seq_len: int = _help(256, "longest sequence the model accepts (size of learned positions / RoPE table)")
    dropout: float = _help(0.0, "dropout probability on attention weights and residual branches")
    positions: str = _help("rope", "gpt positions: 'rope' (rotary) or 'learned'; switch always uses T5 relative bias")
    rope_theta: float = _help(10000.0, "RoPE base frequency")
    rel_pos_buckets: int = _help(32, "switch: number of relative-position buckets (T5)")
    rel_pos_max_distance: int = _help(128, "switch: distance beyond which relative positions share a bucket (T5)")
    tie_embeddings: bool = _help(True, "share the token embedding and output projection weights")
    norm: str = _help("rmsnorm", "normalisation: 'rmsnorm' or 'layernorm' (switch requires rmsnorm)")
    norm_eps: float = _help(1e-6, "epsilon of the norm layers")
    activation: str = _help("gelu", "FFN/expert activation: gelu, gelu_tanh, relu, silu, swiglu, geglu, ... (moe.ACTIVATIONS)")
    bias: bool = _help(False, "gpt: biases in attention and FFN linears (switch never has biases)")
    init_std: float = _help(0.02, "std of the normal init; output projections use init_std/sqrt(2*n_layers)")
    n_kv_heads: int = _help(0, "gpt: key/value heads (grouped-query attention, each shared by n_heads/n_kv_heads query heads); 0 = n_heads")
    head_dim: int = _help(0, "gpt: width of each head (mla: of its non-rotary query/key part); 0 = d_model / n_heads")
    qk_norm: bool = _help(False, "gpt: RMSNorm over each query and key head before the rotary (Qwen3)")
    attention: str = _help("mha", "gpt attention: 'mha' (multi-head, grouped-query with n_kv_heads) or 'mla' (DeepSeek multi-head latent attention)")
    q_lora_rank: int = _help(0, "mla: rank of the compressed query (a down and an up projection with a norm between); 0 = one query projection")
    kv_lora_rank: int = _help(512, "mla: rank of the compressed key/value latent")
    qk_rope_head_dim: int = _help(64, "mla: rotary part of each query/key head (the key's is shared by all heads)")
    v_head_dim: int = _help(0, "mla: width of each value head; 0 = head_dim")
    mtp_depth: int = _help(0, "gpt: multi-token prediction depths (DeepSeek-V3's MTP: depth k predicts the token k+1 ahead through a block of its own and the shared head); 0 = off")
    mtp_loss_coef: float = _help(0.1, "weight of the MTP loss: mtp_loss_coef / mtp_depth x the sum of the depths' cross entropies, added to the main loss")

    def validate(self) -> "ModelConfig":
        s = "model"
        _choice(self, s, "arch", ARCHS)
        _positive_int(self, s, ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff",
                                "max_seq_len", "rel_pos_buckets", "rel_pos_max_distance"))
        self._check_attention()
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        _choice(self, s, "positions", POSITIONS)
        _choice(self, s, "norm", NORMS)
        from moe.experts import ACTIVATIONS  # the single list of supported activations
        _choice(self, s, "activation", sorted(ACTIVATIONS))
        if self.arch == "switch" and self.norm != "rmsnorm":
            raise ValueError("model.norm must be 'rmsnorm' for arch='switch' (T5 style)")
        for n in ("init_std", "norm_eps", "rope_theta"):
            if not getattr(self, n) > 0:
                raise ValueError(f"model.{n}={getattr(self, n)} must be > 0")
        self._check_mtp()
        return self

    def _check_mtp(self) -> None:
        d = self.mtp_depth
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"model.mtp_depth={d!r} must be an integer >= 0 (0 = no multi-token prediction)")
        if not self.mtp_loss_coef >= 0:
            raise ValueError(f"model.mtp_loss_coef={self.mtp_loss_coef} must be >= 0")
        if d and self.arch != "gpt":
            raise ValueError(f"model.mtp_depth={d} is implemented for model.arch='gpt' only; "
                             f"set model.mtp_depth=0")
        if d and self.positions != "rope":
            raise ValueError(f"model.mtp_depth={d} needs model.positions='rope' (the MTP embedding "
                             f"of token i+k has no learned position of its own, as in Megatron-Core)")

    def _check_attention(self) -> None:
        for n in ("n_kv_heads", "head_dim", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                  "v_head_dim"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"model.{n}={v!r} must be an integer >= 0")
        _choice(self, "model", "attention", ATTENTIONS)
        if self.qk_norm not in (True, False):
            raise ValueError(f"model.qk_norm={self.qk_norm!r} must be true or false")
        if self.arch != "gpt":
            changed = [n for n in ("n_kv_heads", "head_dim", "qk_norm") if getattr(self, n)]
            changed += ["attention"] if self.attention != "mha" else []
            if changed:
                raise ValueError(f"model.{changed[0]} is implemented for model.arch='gpt' only; "
                                 f"remove it for arch={self.arch!r}")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads={self.n_heads} does not divide model.d_model="
                             f"{self.d_model}; pick n_heads that divides d_model or set model.head_dim")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads="
                             f"{self.n_heads}; pick a divisor (0 = n_heads)")
        if self.attention == "mla":
            if self.n_kv_heads or self.qk_norm:
                raise ValueError("model.attention='mla' has no separate key/value heads or qk_norm; "
                                 "set model.n_kv_heads=0 and model.qk_norm=false")
            if self.positions != "rope" or self.kv_lora_rank < 1 or self.qk_rope_head_dim < 2:
                raise ValueError("model.attention='mla' needs model.positions='rope', "
                                 "model.kv_lora_rank >= 1 and model.qk_rope_head_dim >= 2")
        if self.arch == "gpt" and self.positions == "rope" and self.rope_dim % 2:
            raise ValueError(f"model.positions='rope' needs an even rotary width, got {self.rope_dim}; "
                             f"change model.d_model, model.n_heads or model.head_dim")

    # ---- attention widths (one answer for the model, the planner and the pipeline balancer)
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def nope_dim(self) -> int:
        """Each head's width (mla: its non-rotary query/key part)."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def qk_dim(self) -> int:
        """Width of each query/key head as attention scores it."""
        return self.nope_dim + (self.qk_rope_head_dim if self.attention == "mla" else 0)

    @property
    def v_dim(self) -> int:
        return (self.v_head_dim or self.nope_dim) if self.attention == "mla" else self.nope_dim

    @property
    def rope_dim(self) -> int:
        """Width the rotary embedding turns (mla: the rotary part only)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.nope_dim

    def attention_params(self) -> int:
        """Matmul weights of one self-attention module (no biases, no norms)."""
        D, H = self.d_model, self.n_heads
        if self.attention == "mla":
            q = (D * self.q_lora_rank + self.q_lora_rank * H * self.qk_dim if self.q_lora_rank
                 else D * H * self.qk_dim)
            kv = D * (self.kv_lora_rank + self.qk_rope_head_dim) + \
                self.kv_lora_rank * H * (self.nope_dim + self.v_dim)
            return q + kv + H * self.v_dim * D
        return D * (H + 2 * self.kv_heads) * self.nope_dim + H * self.nope_dim * D

    def attention_score_width(self) -> int:
        """Multiply-adds per (query, key) pair over all heads: QK^T and AV."""
        return self.n_heads * (self.qk_dim + self.v_dim)

    def attention_saved_width(self) -> int:
        """Elements per token attention saves for backward beyond its input: query, key and
        value heads, the core's output, and the latents of mla. Grouped-query attention
        keeps one key and value head per kv head where the flash kernel reads the groups
        (models/layers.py flash_reads_kv_groups: causal attention without an additive mask,
        the GPT blocks); the T5 blocks' position bias makes them repeated to every query head."""
        H = self.n_heads
        kv = self.kv_heads if self.arch == "gpt" else H
        core = (H + kv) * (self.qk_dim + self.v_dim)
        if self.attention == "mla":
            core += self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim
        return core


@dataclass
class MoEConfig:
    num_experts: int = _help(8, "experts per MoE layer")
    top_k: int = _help(2, "experts per token (1 = Switch, 2 = GShard/Mixtral); for expert_choice: the mean fan-out")
    capacity_factor: Optional[float] = _help(
        None, "expert capacity = ceil(cf * S * top_k / E) per sequence; 0 or \"none\" = dropless")
    eval_capacity_factor: Union[float, str, None] = _help(
        "same", "capacity factor in eval; \"same\" = as capacity_factor; 0 or \"none\" = dropless")
    every: int = _help(2, "MoE FFN in blocks i with (i+1) % every == 0 (and i >= first_moe_layer); 0 = dense model")
    first_moe_layer: int = _help(0, "no MoE block before this block index")
    d_ff: int = _help(0, "hidden size of each expert; 0 = model.d_ff")
    router: str = _help("token_choice", "routing: 'token_choice' or 'expert_choice'")
    aux_loss_coef: float = _help(0.01, "weight of the load-balancing loss (Switch: 0.01)")
    z_loss_coef: float = _help(0.001, "weight of the router z-loss (ST-MoE: 0.001)")
    jitter: float = _help(0.0, "multiplicative input jitter on router inputs during training (Switch: 0.01)")
    num_shared_experts: int = _help(0, "always-on shared experts added to the routed output (DeepSeek-MoE)")
    bias_update_rate: float = _help(0.0, "aux-loss-free balancing: selection-bias step per update; 0 = off")
    score_func: str = _help("softmax", "router scores: 'softmax' or 'sigmoid' (DeepSeek-V3); gates come from them")
    norm_topk_prob: Optional[bool] = _help(None, "renormalise the k selected gates: unset = iff top_k >= 2; true/false forces it")
    n_group: int = _help(1, "group-limited routing (DeepSeek-V3): experts in n_group groups; 1 = no limit")
    topk_group: int = _help(0, "groups a token may use, ranked by their top-2 scores; 0 = all n_group")
    routed_scaling_factor: float = _help(1.0, "multiplies the routed gates (DeepSeek-V3: 2.5)")
    router_bias: bool = _help(False, "learned bias on the router logits (GPT-OSS, Switch router_bias)")
    shared_expert_gate: bool = _help(False, "scale the shared experts' output by a learned sigmoid gate (Qwen2-MoE)")
    swiglu_alpha: float = _help(1.702, "activation='clamped_swiglu' (GPT-OSS): sigmoid slope alpha")
    swiglu_limit: float = _help(7.0, "activation='clamped_swiglu' (GPT-OSS): clamp limit of gate and up projections")
    balance_loss: str = _help("sequence", "load-balance loss over: 'sequence', 'micro_batch' or 'global_batch' (all micro-batches and dp ranks of a step)")
    experts_impl: str = _help("auto", "expert matmuls: 'loop' (per-expert fused loop), 'grouped_mm' (torch._grouped_mm) or 'auto' (measured-faster per device/dtype)")
    force_balance: bool = _help(False, "BENCHMARKING ONLY: ignore the router's expert choice and spread assignments evenly (gates kept)")
    a2a_overlap_degree: int = _help(1, "under expert parallelism: cut each MoE layer's all-to-all into this many chunks, chunk c+1's exchange flying while the experts compute chunk c (same function); 1 = off, needs parallel.ep > 1")
    router_replay: str = _help("", "router replay (train.py): a routing record written by `python -m trainer.generate --record-routing FILE`; training runs on its sequences and every MoE layer sends each token to the recorded experts (gates from the current router); '' = off")
    dispatch_dtype: str = _help("auto", "the rows of the expert all-to-all: 'auto' (the compute dtype: bf16 under parallel.precision=bf16, fp32 under fp32; every direction), 'fp32', 'bf16', or 'fp8' (forward dispatch as float8 e4m3 with one fp32 scale per 128 channels of a row, dequantized on arrival; combine and both backwards bf16). Part of the layer's function: one process rounds the same way")
    dispatch: str = _help("flat", "the expert all-to-all over nodes: 'flat' (one row per assignment to its expert's rank) or 'hierarchical' (a token crosses to a node once, to the rank with the same local index there, which forwards it to its node's experts; the combine sums a token's rows inside the node before they cross back: DeepSeek-V3/DeepEP); nodes from parallel.gpus_per_node; needs parallel.ep > 1")
    max_nodes: int = _help(0, "node-limited routing (DeepSeek-V3: 4): each token's experts lie on at most this many of the nodes the experts live on (parallel.ep over parallel.gpus_per_node), the nodes ranked by the sum of their top max(1, top_k // max_nodes) scores; 0 = no limit; needs parallel.ep > 1, no replicas")
    replica_slots: int = _help(0, "hot-expert replication under expert parallelism: extra expert slots per ep rank for replicas of the step's hottest experts (same function, rows per rank nearer the mean); 0 = off, needs parallel.ep > 1")
    gates_in_experts: bool = _help(False, "apply each routed row's gate inside its expert (its hidden activation scaled before the output projection) so the combine is a plain sum: one d_model row less kept for backward per routed assignment (Megatron-Core's placement); under expert parallelism the fp32 gates travel with the rows. Same function, rounded at another point")

    def __post_init__(self):
        # normalise what we can; leave junk in place for validate() to report
        try:
            self._normalise()
        except ValueError:
            pass

    def _normalise(self) -> None:
        self.capacity_factor = parse_capacity_factor(self.capacity_factor, "moe.capacity_factor")
        e = self.eval_capacity_factor
        if not (isinstance(e, str) and e.strip().lower() == "same"):
            self.eval_capacity_factor = parse_capacity_factor(e, "moe.eval_capacity_factor")

    def validate(self, model_cfg: Optional[ModelConfig] = None) -> "MoEConfig":
        self._normalise()
        s = "moe"
        if self.every == 0:
            return self  # dense model: the remaining fields are unused
        _positive_int(self, s, ("num_experts", "top_k"))
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}; "
                             f"use top_k <= num_experts")
        for n in ("every", "first_moe_layer", "d_ff", "num_shared_experts", "replica_slots"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"moe.{n}={v!r} must be an integer >= 0")
        d = self.a2a_overlap_degree
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"moe.a2a_overlap_degree={d!r} must be an integer >= 1 (1 = off)")
        _choice(self, s, "router", ROUTERS)
        _choice(self, s, "score_func", SCORE_FUNCS)
        _choice(self, s, "balance_loss", BALANCE_LOSSES)
        _choice(self, s, "experts_impl", EXPERT_IMPLS)
        _choice(self, s, "dispatch_dtype", DISPATCH_DTYPES)
        _choice(self, s, "dispatch", DISPATCH_MODES)
        m = self.max_nodes
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"moe.max_nodes={m!r} must be an integer >= 0 (0 = no limit)")
        if m and self.router != "token_choice":
            raise ValueError(f"moe.max_nodes={m} limits the nodes a token's experts lie on, which "
                             f"needs moe.router='token_choice'; set moe.max_nodes=0")
        if self.force_balance not in (True, False):
            raise ValueError(f"moe.force_balance={self.force_balance!r} must be true or false")
        if self.gates_in_experts not in (True, False):
            raise ValueError(f"moe.gates_in_experts={self.gates_in_experts!r} must be true or false")
        if self.force_balance and self.router != "token_choice":
            raise ValueError(f"moe.force_balance=true needs moe.router='token_choice' "
                             f"({self.router!r} is balanced by construction)")
        if self.router == "expert_choice" and self.balance_loss != "sequence":
            raise ValueError(f"moe.balance_loss={self.balance_loss!r} needs moe.router='token_choice'")
        if self.norm_topk_prob not in (None, True, False):
            raise ValueError(f"moe.norm_topk_prob={self.norm_topk_prob!r} must be true, false or unset")
        for n in ("n_group", "topk_group"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if n == "n_group" else 0):
                raise ValueError(f"moe.{n}={v!r} must be an integer >= {1 if n == 'n_group' else 0}")
        if self.topk_group > self.n_group:
            raise ValueError(f"moe.topk_group={self.topk_group} exceeds moe.n_group={self.n_group}; "
                             f"use topk_group <= n_group (0 = all)")
        if self.n_group > 1 and (self.num_experts % self.n_group or self.num_experts // self.n_group < 2):
            raise ValueError(f"moe.n_group={self.n_group} must divide moe.num_experts="
                             f"{self.num_experts} into groups of at least 2 experts")
        for n in ("routed_scaling_factor", "swiglu_limit"):
            if not getattr(self, n) > 0:
                raise ValueError(f"moe.{n}={getattr(self, n)} must be > 0")
        for n in ("aux_loss_coef", "z_loss_coef", "jitter", "bias_update_rate"):
            if getattr(self, n) < 0:
                raise ValueError(f"moe.{n}={getattr(self, n)} must be >= 0")
        if self.jitter >= 1:
            raise ValueError(f"moe.jitter={self.jitter} must be < 1 (inputs are scaled by U(1-j, 1+j))")
        if model_cfg is not None and not self.moe_block_ids(model_cfg.n_layers):
            raise ValueError(f"moe.every={self.every} with moe.first_moe_layer={self.first_moe_layer} "
                             f"puts no MoE block in model.n_layers={model_cfg.n_layers}; lower them "
                             f"or set moe.every=0 for a dense model")
        return self

    @property
    def enabled(self) -> bool:
        return self.every > 0

    @property
    def resolved_eval_capacity_factor(self):
        e = self.eval_capacity_factor
        return self.capacity_factor if isinstance(e, str) and e.strip().lower() == "same" else e

    def routing_kwargs(self) -> dict:
        """The MoELayer keyword arguments of the routing and expert-execution options above."""
        return dict(score_func=self.score_func, norm_topk_prob=self.norm_topk_prob,
                    n_group=self.n_group, topk_group=self.topk_group or None,
                    routed_scaling_factor=self.routed_scaling_factor, router_bias=self.router_bias,
                    shared_expert_gate=self.shared_expert_gate, swiglu_alpha=self.swiglu_alpha,
                    swiglu_limit=self.swiglu_limit, balance_loss=self.balance_loss,
                    experts_impl=self.experts_impl, force_balance=self.force_balance,
                    replica_slots=self.replica_slots, a2a_overlap_degree=self.a2a_overlap_degree,
                    dispatch_dtype=self.dispatch_dtype, dispatch=self.dispatch,
                    max_nodes=self.max_nodes or None, gates_in_experts=self.gates_in_experts)

    def is_moe_block(self, i: int) -> bool:
        return self.every > 0 and i >= self.first_moe_layer and (i + 1) % self.every == 0

    def moe_block_ids(self, n_layers: int) -> list:
        return [i for i in range(n_layers) if self.is_moe_block(i)]
