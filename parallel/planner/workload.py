"""What is being trained, independent of the layout: the model (built on meta), the batch,
the token streams, the optimizer and the routing assumption for dropless MoE layers.

Shapes: B global batch in sequences, S tokens per sequence of a stream, D model dim,
F ffn dim, E experts, K top-k, V vocabulary.
"""
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from moe.config import routes_per_sequence
from moe.experts import ACTIVATIONS


@dataclass(frozen=True)
class Workload:
    build_model: Callable          # () -> the whole single-device model on the meta device
    model_cfg: object              # models.config.ModelConfig
    moe_cfg: object                # models.config.MoEConfig
    batch_size: int                # global sequences per optimizer step (train.batch_size)
    stream_tokens: dict            # {"decoder": S} (gpt) or {"encoder": S_in, "decoder": S_out}
    micro_batch_size: int = 0      # sequences per forward without pipeline (0 = whole per-rank batch)
    optimizer: str = "adamw"       # adamw | adafactor | muon
    imbalance: float = 1.0         # dropless MoE: rows the busiest expert-parallel rank receives / mean
    check: Callable = None         # plan -> validated plan, raising ValueError (default: ParallelPlan.validate)
    build_stage: Callable = None   # (block ids) -> the model with only those blocks its own
                                   # (the others shared with a template that nothing modifies:
                                   # a pipeline rank's read copies 1/pp of the model); None = build_model
    nodes_per_token: float = 0.0   # measured distinct nodes of a token's experts (a load profile's
                                   # nodes_per_token mean); 0 = from routing (expert_nodes.py)

    @property
    def gated(self) -> bool:
        return ACTIVATIONS.get(self.model_cfg.activation, (None, False))[1]

    @property
    def expert_d_ff(self) -> int:
        return self.moe_cfg.d_ff or self.model_cfg.d_ff

    def has_moe(self) -> bool:
        return self.moe_cfg is not None and self.moe_cfg.every > 0 and self.moe_cfg.num_experts > 0

    def moe_whole_sequences(self) -> bool:
        """MoE layers that route per sequence (a capacity, expert choice:
        moe.config.routes_per_sequence): 1-D tp hands them whole sequences by an all-to-all,
        where dropless token choice routes tp's sequence split as it is."""
        m = self.moe_cfg
        return self.has_moe() and routes_per_sequence(m.router, m.capacity_factor,
                                                      m.eval_capacity_factor)

    def is_moe_block(self, i: int) -> bool:
        return i in self._moe_ids

    @cached_property
    def _moe_ids(self) -> frozenset:
        """The MoE blocks' indices (per stack; the MTP depths' as the last block's): the search
        asks millions of times."""
        if not self.has_moe():
            return frozenset()
        n = self.model_cfg.n_layers
        ids = self.moe_cfg.moe_block_ids(n)
        return frozenset(ids + (self.mtp_block_ids() if n - 1 in ids else []))

    def mtp_block_ids(self) -> list:
        """The multi-token prediction depths' blocks (model.mtp_depth), numbered after the
        model's: n_layers + k, as models/blocks.blocks lists them."""
        n = self.model_cfg.n_layers
        return list(range(n, n + getattr(self.model_cfg, "mtp_depth", 0)))

    def blocks_on(self, state, plan) -> list:
        """Block indices (per stack) this rank runs: its pipeline stage's, or all of them;
        the MTP depths' blocks (mtp_block_ids) with the last stage's."""
        main = list(state.block_ids) if plan.pp > 1 else list(range(self.model_cfg.n_layers))
        return main + (self.mtp_block_ids() if plan.pp == 1 or state.last_stage else [])

    def validate(self, plan, world: int):
        """The plan resolved for `world` (dp, microbatches), or ValueError naming the field."""
        if self.check is not None:
            return self.check(plan, world)
        return plan.validate(world, self.model_cfg, self.moe_cfg, self.batch_size,
                             self.stream_tokens.get("decoder"))
