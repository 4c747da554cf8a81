"""Expert parallelism applied from outside: shard every MoE layer's experts over a group
(their checkpoint view, which lets DCP reshard expert slices to any layout: state_dict.py).

Shapes: E experts, P ranks of the expert-parallel group, L = E/P local experts.
Rank r of P keeps global experts [r*L, (r+1)*L) of every MoE layer; tokens reach them by the
all-to-all of moe/ep_dispatcher.py. Groups come from parallel/mesh.py (the "ep" dim);
gradient reduction of the expert slices (over "edp") is parallel/data_parallel/grad_sync.py's.
A layer built with replica_slots=R > 0 also serves replicas of each step's hottest experts
(moe/placement.py, moe/ep_dispatcher.py): fetched from the owners every forward, their
gradients summed into the owners in backward, so nothing here (checkpoints, gradient sync)
sees them.
"""

import torch.distributed as dist

from moe.aux import moe_layers
from moe.nodes import expert_nodes, one_node
from moe.ep_dispatcher import check_shardable, shard_layer_experts
from moe.expert_tp import check_ffn_shardable, split_layer_ffn


from .kinds import is_expert_param  # noqa: F401  (its home is kinds.py; this name is documented)

__all__ = ["apply_expert_parallel", "apply_expert_tensor_parallel", "is_expert_param"]


def apply_expert_parallel(model, ep_group, stage_only: bool = False, ranks_per_node=None) -> list:
    """Shard the experts of every MoELayer in `model` over `ep_group` (in place).

    The model must hold full, identical weights on all ranks (or still be on the meta
    device); each rank keeps its slice. All layers are checked before any is changed.
    Returns [(name, layer)]. Their all-to-all bytes are counted by parallel/ledger.py.
    stage_only: `model` is one pipeline rank's part of a model (its ep group lies inside
    the stage, so all of its ranks hold the same blocks); a part without MoE layers (the
    dense first layers of DeepSeek-V3) has nothing to shard and returns [].
    ranks_per_node: global ranks per node (parallel.gpus_per_node; None: one node): layers
    with moe.dispatch=hierarchical or moe.max_nodes learn which ep ranks share a node
    (moe/nodes.py; an uneven layout is refused before any layer changes).
    """
    nodes = _nodes_of(model, ep_group, ranks_per_node)
    layers = _every_layer(model, ep_group, check_shardable, shard_layer_experts,
                          "expert parallelism", "ep", stage_only)
    if nodes is not None:
        for _, layer in layers:
            layer.set_expert_nodes(nodes)
    return layers


def _nodes_of(model, ep_group, ranks_per_node):
    """The ExpertNodes of ep_group when a layer needs them, else None."""
    needs = any(layer.dispatch != "flat" or layer.router.config.max_nodes is not None
                for _, layer in moe_layers(model))
    if not needs or ep_group is None:
        return None
    ranks = dist.get_process_group_ranks(ep_group)
    return expert_nodes(ranks, ranks_per_node) if ranks_per_node else one_node(len(ranks))


def apply_expert_tensor_parallel(model, etp_group, stage_only: bool = False) -> list:
    """Split every MoELayer's experts' d_ff over `etp_group` (in place; moe/expert_tp.py):
    rank j keeps block j of w1/w3 columns and w2 rows. All layers are checked before any is
    changed. Returns [(name, layer)]."""
    return _every_layer(model, etp_group, check_ffn_shardable, split_layer_ffn,
                        "expert tensor parallelism", "etp", stage_only)


def _every_layer(model, group, check, change, what: str, field: str, stage_only: bool) -> list:
    """check(layer, group) every MoELayer (errors name the layer), then change(layer, group)."""
    layers = moe_layers(model)
    if not layers and not stage_only:
        raise ValueError(f"{what}: the model has no MoELayer; use parallel.{field}=1 for a dense model")
    for name, layer in layers:
        try:
            check(layer, group)
        except ValueError as e:
            raise ValueError(f"{name or 'the layer'}: {e}") from None
    for _, layer in layers:
        change(layer, group)
    return layers


def __getattr__(name: str):
    # an earlier README documented `from parallel.expert import comm_counters`; the per-layer
    # byte counters it read were replaced by one ledger for every collective (wave 3)
    if name == "comm_counters":
        raise ImportError("parallel.expert.comm_counters was replaced by parallel.ledger.CommLedger, "
                          "which counts every collective by kind (expert_all_to_all, ...): "
                          "`with par.recording_comm(): ...; par.ledger.take()`")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
