"""Expert-load profile: run a model over held-out batches and report how its routers behave.

Shapes: T tokens, E experts, K top-k, A assignments (kept token copies), P expert-parallel
ranks, n nodes the experts span (router config's expert_nodes).
`profile_model` works on any model holding MoELayers (ours or a moefied Hugging Face one). It
watches each layer's router through a forward hook that reads the Routing it returns, so the
layer's contract is untouched. Writes out_dir/load.json, out_dir/load.png and TensorBoard
(out_dir/tensorboard, or a writer you pass, e.g. the training run's).

Rows per expert-parallel rank, with and without hot-expert replication: measured (the
layer's `last_stats.rank_rows`) when the model runs expert-parallel; for a one-process model
given `ep=(P, R)`, planned per batch by moe.placement from that batch's expert counts (exactly
what P ranks with R replica slots would receive for the same global batch).

Nodes per token, when a layer's experts span n > 1 nodes (contiguous blocks of E/n, as
moe/nodes.py lays them out): how many distinct nodes each token's chosen experts (before
capacity) lie on; its mean, max and the tokens reaching each count 1..n (what moe.max_nodes
bounds). A one-process model reports it after `python -m trainer.profile --nodes n`.

CLI: python -m trainer.profile --config CONFIG.toml [--checkpoint DIR] --out DIR [--batches N]
"""
import json
import math
import os

import torch

from ..aux import moe_layers
from .heatmap import heatmap_figure
from ..placement import plan_placement


class _LayerTally:
    """Running totals for one MoE layer over all profiled batches."""

    def __init__(self, name: str, layer):
        E = layer.num_experts
        self.name, self.num_experts, self.top_k = name, E, layer.top_k
        self.routed_E = torch.zeros(E, dtype=torch.long)
        self.kept_E = torch.zeros(E, dtype=torch.long)
        self.tokens, self.entropy_sum = 0, 0.0
        self.pairs = []          # per batch: long [A, 2] (expert, token id), or None if unknown
        self.stream = "decoder" if "decoder" in name.split(".") else "encoder"
        self.rank_rows = self.rank_rows_unreplicated = None   # long [P], summed over batches
        self.rank_rows_source = None
        config = layer.router.config
        self.expert_nodes, self.max_nodes = config.expert_nodes, config.max_nodes
        # tokens by the number of distinct nodes their experts lie on (index 0 unused)
        self.tokens_by_nodes = (torch.zeros(self.expert_nodes + 1, dtype=torch.long)
                                if self.expert_nodes > 1 else None)

    def add_rank_rows(self, stats, ep) -> None:
        """After a layer forward: its rows per ep rank (measured, or planned for ep=(P, R))."""
        if stats.rank_rows.numel() > 1 or ep is None or ep[0] == 1:
            rows, source = stats.rank_rows.cpu(), "measured"
            # no replicas in this layer: without replication the rows are these rows
            unrep = rows if stats.rank_rows_unreplicated is None else stats.rank_rows_unreplicated.cpu()
        else:
            pl = plan_placement(stats.kept_E.tolist(), *ep)
            rows, unrep = torch.tensor(pl.rank_rows), torch.tensor(pl.owner_rows)
            source = f"planned for ep={ep[0]} replica_slots={ep[1]} from one-process counts"
        if self.rank_rows is None:
            self.rank_rows, self.rank_rows_unreplicated = rows.clone(), unrep.clone()
        else:
            self.rank_rows += rows
            self.rank_rows_unreplicated += unrep
        self.rank_rows_source = source

    def add(self, routing, ids_T) -> None:
        expert_A = routing.expert_A.detach().cpu()
        kept_A = expert_A < self.num_experts  # dropped assignments carry expert id E
        self.routed_E += routing.routed_E.detach().cpu()
        self.kept_E += routing.kept_E.detach().cpu()
        self.tokens += routing.num_tokens
        self.entropy_sum += float(routing.entropy) * routing.num_tokens
        if self.tokens_by_nodes is not None and routing.ids_GSK is not None:
            self.tokens_by_nodes += tokens_by_nodes(routing.ids_GSK.detach().cpu(),
                                                    self.num_experts, self.expert_nodes)
        if ids_T is not None and ids_T.numel() == routing.num_tokens:
            token_ids_A = ids_T.reshape(-1).cpu()[routing.token_A.detach().cpu()]
            self.pairs.append(torch.stack([expert_A, token_ids_A], dim=1)[kept_A])
        else:
            self.pairs.append(None)   # e.g. a chunked FFN: token rows cannot be matched to ids


def tokens_by_nodes(ids_GSK: torch.Tensor, num_experts: int, num_nodes: int) -> torch.Tensor:
    """long [n + 1]: at index c, the tokens whose experts lie on exactly c distinct nodes."""
    node_TK = ids_GSK.reshape(-1, ids_GSK.shape[-1]) // (num_experts // num_nodes)
    on_node_Tn = torch.zeros(node_TK.shape[0], num_nodes, dtype=torch.bool)
    on_node_Tn.scatter_(1, node_TK, True)
    return torch.bincount(on_node_Tn.sum(dim=1), minlength=num_nodes + 1)


def _nodes_report(tally: _LayerTally):
    counts = tally.tokens_by_nodes
    if counts is None or counts.sum() == 0:
        return None
    reached = torch.nonzero(counts).flatten()
    return {"expert_nodes": tally.expert_nodes, "max_nodes": tally.max_nodes,
            "mean": float((counts * torch.arange(counts.numel())).sum() / counts.sum()),
            "max": int(reached.max()),
            "tokens": counts[1:].tolist()}    # tokens whose experts span 1, 2, ..., n nodes


def _streams(batch) -> dict:
    """The token ids each stack sees: {'encoder': ids, 'decoder': ids or None}."""
    if isinstance(batch, dict):
        return {"encoder": batch.get("input_ids"), "decoder": batch.get("decoder_input_ids")}
    if isinstance(batch, (tuple, list)):
        second = batch[1] if len(batch) > 1 and torch.is_tensor(batch[1]) else None
        return {"encoder": batch[0], "decoder": second}
    return {"encoder": batch, "decoder": None}


def _call(model, batch, device):
    move = (lambda t: t.to(device) if torch.is_tensor(t) else t)
    if isinstance(batch, dict):
        return model(**{k: move(v) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        return model(*[move(v) for v in batch])
    return model(move(batch))


def _decode(tokenizer, token_id: int):
    if tokenizer is None:
        return None
    try:
        return tokenizer.decode([token_id])
    except Exception:  # a tokenizer that cannot decode one id alone: report the id only
        return None


def _top_tokens(tally: _LayerTally, tokenizer, top_n: int):
    if not tally.pairs or any(p is None for p in tally.pairs):
        return None
    pairs = torch.cat(tally.pairs)
    uniq, counts = torch.unique(pairs, dim=0, return_counts=True)
    out = []
    for e in range(tally.num_experts):
        mine = uniq[:, 0] == e
        ids, n = uniq[mine, 1], counts[mine]
        order = torch.argsort(n, descending=True, stable=True)[:top_n]
        out.append([{"id": int(ids[i]), "count": int(n[i]), "text": _decode(tokenizer, int(ids[i]))}
                    for i in order])
    return out


def _max_over_mean(rows) -> float:
    return 0.0 if rows is None or rows.sum() == 0 else float(rows.max() / rows.double().mean())


def layer_report(tally: _LayerTally, tokenizer=None, top_n: int = 8) -> dict:
    kept = tally.kept_E.double()
    total = float(kept.sum())
    mean = total / tally.num_experts
    share = (kept / total).tolist() if total else [0.0] * tally.num_experts
    routed = int(tally.routed_E.sum())
    return {
        "name": tally.name, "num_experts": tally.num_experts, "top_k": tally.top_k,
        "tokens": tally.tokens,
        "counts": tally.kept_E.tolist(),      # assignments processed per expert
        "routed": tally.routed_E.tolist(),    # assignments chosen per expert, before capacity
        "share": share,
        "dropped": routed - int(total),
        "dropped_fraction": (routed - total) / routed if routed else 0.0,
        "imbalance": float(kept.max()) / mean if mean else 0.0,    # max/mean, 1 = balanced
        "cv": float(kept.std(unbiased=False)) / mean if mean else 0.0,
        "entropy": tally.entropy_sum / max(tally.tokens, 1),
        "entropy_max": math.log(tally.num_experts),
        "dead_experts": torch.nonzero(tally.kept_E == 0).flatten().tolist(),
        "top_tokens": _top_tokens(tally, tokenizer, top_n),
        # rows per expert-parallel rank, after / without hot-expert replication (sums over
        # batches), their max/mean, and whether measured or planned (see module docstring)
        "rank_rows": None if tally.rank_rows is None else tally.rank_rows.tolist(),
        "rank_rows_unreplicated": (None if tally.rank_rows_unreplicated is None
                                   else tally.rank_rows_unreplicated.tolist()),
        "rank_imbalance": _max_over_mean(tally.rank_rows),
        "rank_imbalance_unreplicated": _max_over_mean(tally.rank_rows_unreplicated),
        "rank_rows_source": tally.rank_rows_source,
        "nodes_per_token": _nodes_report(tally),   # None unless experts span > 1 node
    }


def _summary(layers: list) -> dict:
    worst = max(layers, key=lambda r: r["imbalance"])
    return {"mean_imbalance": sum(r["imbalance"] for r in layers) / len(layers),
            "max_imbalance": worst["imbalance"], "worst_layer": worst["name"],
            "dead_experts": sum(len(r["dead_experts"]) for r in layers),
            "mean_dropped_fraction": sum(r["dropped_fraction"] for r in layers) / len(layers)}


@torch.no_grad()
def collect_load(model, batches, max_batches=None, ep=None, on_output=None) -> list:
    """Run `model` in eval mode over `batches` (tensors, tuples or kwargs dicts) -> tallies.
    ep=(P, R): plan rows per rank for P expert-parallel ranks with R replica slots when the
    model runs in one process (see the module docstring). on_output(i, output): called with
    batch i's model output (e.g. to score the same forward: trainer.evaluate)."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoELayer to profile; swap its FFNs "
                         f"first with moe.moefy(model, num_experts, top_k)")
    tallies = [_LayerTally(name, layer) for name, layer in layers]
    current = {}   # the token ids of the batch being run, read by the hooks
    hooks = [layer.router.register_forward_hook(
        lambda mod, args, routing, t=t: t.add(routing, current.get(t.stream)))
        for t, (_, layer) in zip(tallies, layers)]
    hooks += [layer.register_forward_hook(
        lambda mod, args, out, t=t: t.add_rank_rows(mod.last_stats, ep))
        for t, (_, layer) in zip(tallies, layers)]
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            current.clear()
            current.update(_streams(batch))
            out = _call(model, batch, device)
            if on_output is not None:
                on_output(i, out)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    if not any(t.tokens for t in tallies):
        raise ValueError("no batches were profiled: `batches` was empty")
    return tallies


def write_outputs(report: dict, out_dir: str, writer=None, step: int = 0) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "load.json"), "w") as f:
        json.dump(report, f, indent=1)
    layers = report["layers"]
    s = report["summary"]
    title = (f"expert load, % of tokens (x = dead expert)\nimbalance max/mean: mean "
             f"{s['mean_imbalance']:.2f}, worst {s['max_imbalance']:.2f} ({s['worst_layer']})")
    fig = heatmap_figure([r["share"] for r in layers], [r["name"] for r in layers],
                         [r["dead_experts"] for r in layers], title)
    fig.savefig(os.path.join(out_dir, "load.png"))
    own = writer is None
    if own:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(out_dir, "tensorboard"))
    _to_tensorboard(writer, layers, fig, step)
    if own:
        writer.close()


def _to_tensorboard(writer, layers: list, fig, step: int) -> None:
    writer.add_figure("moe_load/heatmap", fig, step, close=False)
    for r in layers:
        E, counts = r["num_experts"], r["counts"]
        # one bucket per expert: the histogram's shape *is* the load distribution
        writer.add_histogram_raw(
            f"moe_load/{r['name']}", min=0, max=E - 1, num=sum(counts),
            sum=float(sum(e * c for e, c in enumerate(counts))),
            sum_squares=float(sum(e * e * c for e, c in enumerate(counts))),
            bucket_limits=[e + 0.5 for e in range(E)], bucket_counts=counts, global_step=step)
        for key in ("imbalance", "cv", "entropy", "dropped_fraction", "rank_imbalance",
                    "rank_imbalance_unreplicated"):
            writer.add_scalar(f"moe_load/{r['name']}/{key}", r[key], step)
        writer.add_scalar(f"moe_load/{r['name']}/dead_experts", len(r["dead_experts"]), step)


def profile_model(model, batches, out_dir=None, tokenizer=None, *, max_batches=None,
                  top_n: int = 8, writer=None, step: int = 0, ep=None, on_output=None) -> dict:
    """Profile expert load over `batches`; write load.json, load.png, TensorBoard if out_dir.

    Per layer: counts (sum = tokens * top_k - dropped for token-choice routing), share,
    dropped fraction, imbalance (max/mean), coefficient of variation, router entropy, dead
    experts and the most frequent token ids per expert (decoded when a tokenizer is given),
    rows per expert-parallel rank with and without replication (ep=(P, R): see collect_load),
    nodes per token when the layer's experts span several nodes (see the module docstring).
    Layers the forward never ran (a GPT's multi-token prediction depths, which run only with
    labels in training) are listed under "not_run" instead of as layers with every expert dead.
    """
    tallies = collect_load(model, batches, max_batches, ep, on_output)
    ran = [t for t in tallies if t.tokens > 0]
    layers = [layer_report(t, tokenizer, top_n) for t in ran]
    report = {"batches": len(ran[0].pairs), "layers": layers, "summary": _summary(layers),
              "not_run": [t.name for t in tallies if t.tokens == 0]}
    if out_dir is not None:
        write_outputs(report, out_dir, writer, step)
    return report

