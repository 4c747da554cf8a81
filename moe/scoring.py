"""Router scoring, expert selection and gate values, as pure functions of router logits.

Shapes: T tokens, E experts, K top-k, N blocks of contiguous experts (the n_group groups, or
the expert_nodes nodes), M experts per block (E/N).

The pieces a token-choice router is made of, each a named option of MoELayer:
  scores = softmax(logits) or sigmoid(logits)                 (score_func)
  choice = scores + selection_bias   (selection only, no gradient; aux-loss-free balancing)
  keep only the max_nodes nodes with the largest sum of their top max(1, K // max_nodes)
  choice scores                                 (max_nodes / expert_nodes, DeepSeek-V3 node limit)
  keep only the topk_group groups with the largest sum of their top-2 choice scores
                                                              (n_group / topk_group, DeepSeek-V3)
  ids    = top-k of choice over the kept experts
  gates  = scores[ids], optionally divided by their sum       (norm_topk_prob)
           then times routed_scaling_factor                   (DeepSeek-V3)
"""
import torch

SCORE_FUNCS = ("softmax", "sigmoid")


def scores_from_logits(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """softmax over experts (GShard, Mixtral) or an independent sigmoid per expert (DeepSeek-V3)."""
    if score_func == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    if score_func == "sigmoid":
        return torch.sigmoid(logits_TE)
    raise ValueError(f"score_func={score_func!r} is not supported; use one of {SCORE_FUNCS}")


def balance_probs(scores_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Scores as a distribution over experts, the P of the balance losses.

    Softmax scores already are one; sigmoid scores are divided by their sum per token, as in
    DeepSeek-V3's sequence-wise balance loss.
    """
    if score_func == "softmax":
        return scores_TE
    return scores_TE / scores_TE.sum(dim=-1, keepdim=True)


def block_keep_mask(choice_TE: torch.Tensor, n_blocks: int, keep_blocks: int,
                    per_block: int) -> torch.Tensor:
    """Bool [T, E]: experts in the keep_blocks of n_blocks contiguous blocks whose per_block
    best choice scores sum highest (all experts when keep_blocks >= n_blocks)."""
    T, E = choice_TE.shape
    M = E // n_blocks
    block_score_TN = choice_TE.reshape(T, n_blocks, M).topk(per_block, dim=-1).values.sum(dim=-1)
    kept_TK = block_score_TN.topk(min(keep_blocks, n_blocks), dim=-1).indices
    keep_TN = torch.zeros(T, n_blocks, dtype=torch.bool, device=choice_TE.device)
    keep_TN.scatter_(1, kept_TK, True)
    return keep_TN.repeat_interleave(M, dim=1)


def group_keep_mask(choice_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Bool [T, E]: experts in the topk_group groups whose two best choice scores sum highest.

    Experts are split into n_group contiguous groups of M = E / n_group (DeepSeek-V3 puts a
    group on one node, so a token talks to at most topk_group nodes).
    """
    return block_keep_mask(choice_TE, n_group, topk_group, 2)


def node_keep_mask(choice_TE: torch.Tensor, num_nodes: int, max_nodes: int,
                   top_k: int) -> torch.Tensor:
    """Bool [T, E]: experts on the max_nodes nodes (contiguous blocks of E / num_nodes, as
    moe/nodes.py lays them out) whose best max(1, top_k // max_nodes) choice scores sum
    highest. With top_k=8, max_nodes=4 that is the sum of the top 2 (DeepSeek-V3), the same
    ranking as group_keep_mask with one group per node."""
    per_node = min(max(1, top_k // max_nodes), choice_TE.shape[-1] // num_nodes)
    return block_keep_mask(choice_TE, num_nodes, max_nodes, per_node)


@torch.no_grad()
def select_experts(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int,
                   n_group: int = 1, topk_group: int = 1, expert_nodes: int = 1,
                   max_nodes=None) -> torch.Tensor:
    """ids_TK: the top-k experts by choice = scores + bias, inside the kept nodes (when
    max_nodes < expert_nodes) and then inside the kept groups of what is left (n_group > 1)."""
    if torch.promote_types(scores_TE.dtype, bias_E.dtype) != scores_TE.dtype:
        bias_E = bias_E.to(scores_TE.dtype)
    choice_TE = scores_TE + bias_E  # a narrower bias is widened inside the add
    if max_nodes is not None and max_nodes < expert_nodes:
        keep_TE = node_keep_mask(choice_TE, expert_nodes, max_nodes, top_k)
        choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
    if n_group > 1:
        keep_TE = group_keep_mask(choice_TE, n_group, topk_group)
        choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
    return torch.topk(choice_TE, top_k, dim=-1).indices


def gates_for(scores_TE: torch.Tensor, ids_TK: torch.Tensor, normalize: bool,
              scaling: float = 1.0, logits_TE=None) -> torch.Tensor:
    """gates_TK = scores of the chosen experts (unbiased), renormalised if asked, scaled.
    logits_TE (softmax scores only): renormalised softmax scores are the softmax of the chosen
    logits, computed so (two ops and their two backward ops instead of eleven)."""
    if normalize and logits_TE is not None:
        gates_TK = torch.softmax(logits_TE.gather(-1, ids_TK).to(scores_TE.dtype), dim=-1)
        return gates_TK * scaling if scaling != 1.0 else gates_TK
    gates_TK = scores_TE.gather(-1, ids_TK)
    if normalize:
        gates_TK = gates_TK / gates_TK.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        gates_TK = gates_TK * scaling
    return gates_TK


def check_group_args(num_experts: int, top_k: int, n_group: int, topk_group) -> int:
    """Validate the group-limit arguments; returns topk_group with None resolved to n_group."""
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1:
        raise ValueError(f"n_group={n_group!r} must be an integer >= 1 (1: no group limit)")
    topk_group = n_group if topk_group is None else topk_group
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group!r} must be an integer in [1, n_group={n_group}]")
    if n_group == 1:
        return topk_group
    if num_experts % n_group:
        raise ValueError(f"n_group={n_group} does not divide num_experts={num_experts}; "
                         f"use a divisor of num_experts")
    if num_experts // n_group < 2:
        raise ValueError(f"n_group={n_group} leaves {num_experts // n_group} expert per group; "
                         f"groups are ranked by their top-2 scores, so use n_group <= "
                         f"num_experts/2")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"top_k={top_k} is more than the {topk_group * (num_experts // n_group)} "
                         f"experts in topk_group={topk_group} groups; raise topk_group")
    return topk_group
