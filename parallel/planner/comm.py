"""Bytes this rank hands to collectives in one optimizer step, by ledger kind.

Same payload convention and the same classification as parallel/ledger.py (each event is
a collective class on a group that is a set of mesh dims; ledger.classify names its kind),
so predictions and the ledger's measured `comm_bytes` compare kind by kind.
a = activation element bytes, b sequences per micro-batch per rank, S tokens per sequence,
D model dim, V vocabulary, K top-k, m micro-batches, n MoE layers on the rank.
  gradient sync (zero 0/1/2), per reduction bucket whose group has > 1 rank:
    zero 0/1 all-reduce of the full local gradients; zero 2 reduce-scatter of them padded
    to P equal slices; zero 1/2 all-gather of the updated slices
  zero 3 (FSDP2): per unit, all-gather of its shard in every micro-batch's forward and again
    in backward (the root once: it stays gathered), one reduce-scatter of the padded grads;
    hpZ units gather again in backward over their node's zeropp_hpz ranks from the
    secondary shard (unit bytes / hpz; the root too, it reshards to the node after forward)
  ZeRO++ (parallel/data_parallel/zeropp.py): qwZ gathers and qgZ reduce-scatters send int8 blocks of 256
    plus an fp32 scale each: ceil(n / 256) x 260 bytes for n fp32 values (per chunk of the
    reduce-scatter, which is an all-to-all of P such chunks); offload moves no bytes here
  tied embedding (pp > 1): all-reduce of the held gradient of the shared weight
  pipeline: per micro-batch the activation [b, S, D] forward (not from the last stage)
    and its gradient back (not from the first); plus 8 bytes of loss sums over pp
  expert all-to-all, per MoE layer and micro-batch: A rows dispatched and r A combined
    forward, r A and A rows of gradients backward (A = b S K / tp own rows, r A received at
    imbalance r, capped by the capacity factor), each direction in its moe.dispatch_dtype
    format (moe/wire.py: auto = 2 bytes a channel under bf16/fp16, 4 under fp32; fp8 = D + 4
    ceil(D/128) bytes a row forward, bf16 the rest), + the P x E int64 count table; split
    into bytes inside this rank's node and across nodes, and moe.dispatch=hierarchical's
    two hops, in expert_nodes.py
  expert tensor parallel (etp > 1), per MoE layer and micro-batch: 4 n N rows of D (the
    gather and the partial outputs, forward and backward; N rows reached this rank's
    experts, n = etp) + the n x E/ep int64 count table (_expert_tensor)
  tensor parallel, per micro-batch (the norms' outputs, the residual stream and their
    gradients in its dtype, memory.stream_bytes: fp32 under autocast with fp32 parameters; the
    matmul outputs and their gradients in the activation dtype; an MTP depth's stream is
    eh_proj's output, activation dtype): embedding all-reduce b S D; per block
    attention gather + reduce-scatter and their backward 2 b (S/tp) D + 2 b S D, a dense FFN
    the same again, + b (S/tp) D per input gathered again in backward under
    recompute_modules=layernorm (_regathered), an MoE layer that routes per sequence 4 b (S/tp) D (sequence <-> batch
    all-to-all, both ways), one of dropless token choice the sequence balance loss' [E+1]
    fp32 statistics of the b sequences (it routes tp's sequence split as it is);
    final norm / head gather b (S/tp) D; logits gather b S (V/tp); the sequence split's
    backward gather b (S/tp) D; replicated norm weights' gradient all-reduce; recompute
    repeats the forward collectives of every block
  tensor parallel 2d/2.5d (parallel/tensor/grid.py), per micro-batch, T = b S / (d q) tokens of
    this rank's grid row, r = 4 (the residual stream and norm outputs stay fp32), a the
    matmul outputs' bytes, w = 4 (fp32 weights are gathered before any autocast cast):
    column (tpc): each norm's statistic all-reduces, forward and backward, T x 4 each (one
      for RMSNorm, two for LayerNorm); every gathered matmul input x [T, in/q] hands over
      T in/q forward and reduce-scatters T in backward: attention's x (r, once for q/k/v),
      the dense FFN's x (r), the head's x (r); o and w2 reduce-scatter their partial
      outputs T D (a) forward and gather T D/q backward (MoE layers' shared experts as the
      dense FFN); an MoE
      layer swaps T D/q (r) each way, forward and backward; the embedding reduce-scatters
      T D x 4 forward and gathers T D/q x 4 backward; logits gather T V/q (a)
    row (tpr): every weight [in, out] hands over in out / q^2 (w) forward and reduce-
      scatters in out / q backward (q/k/v/o, w1 (w3) w2, the embedding and the head, a tied
      matrix in both); logits gather T V (a)
    depth (tpd, 2.5d): logits gather q T V (a); per step the gradients of the weights
      replicated over depth all-reduced there, like the row's of the norm weights
      (rank_state.grid_grad_sums); recompute repeats every block's forward collectives
  context parallel (cp > 1): each rank's tokens are S/cp of a sequence (every token term above
    uses S/cp); ring send/recv or Ulysses all-to-alls per attention module (_context)
  other: the gradient-norm all-reduce (4 bytes) and the step's agreement flags (16 bytes)
"""
from collections import Counter

from moe.wire import named_formats, wire_row_bytes

from ..ledger import KINDS, classify
from .expert_nodes import DISPATCH_CALLS, dispatch_mode, ep_nodes, expert_a2a_bytes, nodes_per_token
from .memory import act_bytes, fsdp_wire_ratio, local_tokens, micro_seqs, stream_bytes
from .rank_state import muon_facts


def step_comm(w, plan, state, node_size: int = 8) -> tuple:
    """({kind: bytes}, [(kind, collective, dim, group size, bytes, calls)]) for this rank:
    the kinds of parallel/ledger.py (zeros omitted) and the events behind them (step_time.py
    turns those into seconds; calls: how many collective calls the bytes are spread over,
    which prices each call's latency, see CALLS in the module docstring). node_size: global ranks per node. The expert all-to-all's
    events are split by where the bytes go: dims "ep@intra" (this rank's node, itself
    included) and "ep@inter" (other nodes), see expert_nodes.py."""
    if plan.world == 1:
        return {}, []
    out, events = Counter(), []

    def book(collective, dim, nbytes, calls=1):
        if dim in ("ep@intra", "ep@inter"):  # the expert all-to-all's parts (expert_nodes.py)
            size = ep_nodes(plan, state.rank, node_size).per if dim == "ep@intra" else plan.ep
            if nbytes:
                out["expert_all_to_all"] += int(nbytes)
                events.append(("expert_all_to_all", collective, dim, size, int(nbytes), calls))
            return
        dims, size = state.groups[dim]
        if size > 1 and nbytes:
            kind = classify(collective, set(dims))
            out[kind] += int(nbytes)
            events.append((kind, collective, dim, size, int(nbytes), calls))

    _grad_sync(plan, state, book)
    if plan.zero == 3:
        _fsdp(micro_count(w, plan), plan, state, out, events)
    if state.tied_pair:
        tied = state.tied_bytes if plan.zero != 2 else _tied_slice(state)
        out["tied_embedding"] += tied
        events.append(("tied_embedding", "reduce", "pp", 2, tied, 1))
    _pipeline(w, plan, state, book)
    _experts(w, plan, state, book, node_size)
    _context(w, plan, state, book)
    if plan.tp_mode == "1d":
        _tensor(w, plan, state, book, out, events)
    else:
        _grid_tensor(w, plan, state, book)
    if w.optimizer == "muon" and muon_facts(state, plan) is not None:
        for dim, size, nbytes in muon_facts(state, plan).exchange:  # to the owner and back
            out["muon_orthogonalise"] += nbytes
            events.append(("muon_orthogonalise", "a2a", dim, size, nbytes, 1))
    out["other"] += 20
    return {k: out[k] for k in KINDS if out[k]}, events


QUANT_BLOCK, QUANT_BLOCK_BYTES = 256, 256 + 4   # int8 values + one fp32 scale


def quantized_bytes(fp32_bytes: int) -> int:
    """What zeropp.quantize sends for a flat fp32 tensor of that many bytes."""
    return -(-(fp32_bytes // 4) // QUANT_BLOCK) * QUANT_BLOCK_BYTES


def _grad_sync(plan, state, book) -> None:
    dim_of = {"dense": "dp", "pool": "pool", "expert": "edp"}
    for kind, _dims, size, full, mine, padded in state.buckets:
        dim = dim_of[kind]
        if plan.zero == 2:
            book("scatter", dim, size * quantized_bytes(mine) if plan.zeropp_quantize_grads else padded)
        else:
            book("reduce", dim, full)
        if plan.zero in (1, 2):
            book("gather", dim, mine)


def _fsdp(m: int, plan, state, out, events) -> None:
    """m micro-batches: each gathers the units again; the gradients are reduced once. Under
    param_dtype=bf16 FSDP2 gathers and reduces bf16 casts of its fp32 shards: half the bytes."""
    qw = quantized_bytes if plan.zeropp_quantize_weights else (lambda n: n)
    wire = fsdp_wire_ratio(plan)
    for dims, size, shard, is_root, hpz in state.fsdp_units:
        if size <= 1:
            continue
        shard = int(shard * wire)
        dim = sorted(dims)[0]
        backward = [] if is_root and not hpz else \
            [("gather", "hpz", hpz, qw(shard * size // hpz) * m, m)] if hpz else \
            [("gather", dim, size, qw(shard) * m, m)]
        scatter = size * quantized_bytes(shard) if plan.zeropp_quantize_grads else shard * size
        for collective, on, n, nbytes, calls in [("gather", dim, size, qw(shard) * m, m),
                                                 *backward, ("scatter", dim, size, scatter, 1)]:
            kind = classify(collective, set(dims))
            out[kind] += nbytes
            events.append((kind, collective, on, n, nbytes, calls))


def _tied_slice(state) -> int:
    return state.tied_bytes // state.groups["dp"][1]


def _pipeline(w, plan, state, book) -> None:
    if plan.pp == 1:
        return
    a = 4  # the residual stream between stages stays in the parameters' dtype
    seqs, S = micro_seqs(w, plan), local_tokens(plan, w.stream_tokens["decoder"])
    per_mb = seqs * S * w.model_cfg.d_model * a / plan.tp
    sends = 0
    for chunk in range(plan.stages_per_rank):
        stage = state.rank // plan.pool + chunk * plan.pp
        sends += (stage != plan.num_stages - 1) + (stage != 0)
    book("p2p", "pp", per_mb * plan.microbatches * sends, plan.microbatches * sends)
    book("reduce", "pp", 8)


def micro_count(w, plan) -> int:
    if plan.pp > 1:
        return plan.microbatches
    local = w.batch_size // plan.dp
    return local // (w.micro_batch_size or local)


def _experts(w, plan, state, book, node_size: int) -> None:
    moe_blocks = [i for i in w.blocks_on(state, plan) if w.is_moe_block(i)]
    if plan.etp > 1 and moe_blocks:
        _expert_tensor(w, plan, moe_blocks, book)
    if plan.ep == 1 or not moe_blocks:
        return
    moe, seqs, passes = w.moe_cfg, micro_seqs(w, plan), (2 if plan.recompute == "full" else 1)
    r = w.imbalance if not moe.capacity_factor else min(w.imbalance, moe.capacity_factor)
    rows = a2a_row_bytes(getattr(moe, "dispatch_dtype", "auto"), plan.precision, w.model_cfg.d_model)
    nodes = ep_nodes(plan, state.rank, node_size)
    nu = nodes_per_token(w, nodes)
    intra = inter = 0.0
    for S in w.stream_tokens.values():
        tokens = seqs * local_tokens(plan, S) / plan.tp
        own = tokens * moe.top_k
        if moe.capacity_factor and moe.capacity_factor < 1:
            own *= moe.capacity_factor
        a, b = expert_a2a_bytes(dispatch_mode(moe), tokens, own, r, nu, nodes,
                                moe.num_experts, rows, passes)
        intra, inter = intra + a * len(moe_blocks), inter + b * len(moe_blocks)
    m = micro_count(w, plan)
    spread, inside = a2a_calls(dispatch_mode(moe), passes)
    per = len(moe_blocks) * len(w.stream_tokens) * m
    if inter:   # a call that reaches another node pays the network's latency (step_time.py)
        book("a2a", "ep@intra", intra * m, inside * per)
        book("across", "ep@inter", inter * m, spread * per)
    else:
        book("a2a", "ep@intra", intra * m, (spread + inside) * per)


def a2a_calls(mode: str, passes: int) -> tuple:
    """(calls whose peers span the ep group, calls inside the node) of one MoE layer's
    expert all-to-all per micro-batch: the dispatcher's table (expert_nodes.DISPATCH_CALLS),
    its forward calls once per forward pass."""
    spread = inside = 0
    for call in DISPATCH_CALLS[mode]:
        n = passes if call.phase == "forward" else 1
        spread, inside = (spread + n, inside) if call.reach == "group" else (spread, inside + n)
    return spread, inside


def a2a_row_bytes(mode: str, precision: str, D: int) -> tuple:
    """Bytes of one row of the expert all-to-all: (forward dispatch, forward combine, either
    backward), moe/wire.py's formats (auto: the compute dtype, act_bytes)."""
    if mode == "auto":
        a = act_bytes(precision) * D
        return a, a, a
    dispatch, combine = named_formats(mode)
    return (wire_row_bytes(dispatch.forward, D), wire_row_bytes(combine.forward, D),
            wire_row_bytes(dispatch.backward, D))


def _expert_tensor(w, plan, moe_blocks, book) -> None:
    """moe/expert_tp.py per MoE layer and micro-batch, N = the rows this rank's experts got
    (r A under ep, else A), n = etp: the gather hands over its N rows once per rank (n N rows)
    and the partial outputs of the group's n N rows go back (n N rows); backward mirrors
    both; plus the n x W int64 count table (W = E/ep local experts); under
    moe.gates_in_experts the rows' fp32 gates are gathered beside them (n N x 4 bytes) and
    their gradients come back. Recomputation repeats the forward."""
    moe, seqs, n = w.moe_cfg, micro_seqs(w, plan), plan.etp
    passes = 3 if plan.recompute == "full" else 2
    r = 1.0 if plan.ep == 1 else \
        w.imbalance if not moe.capacity_factor else min(w.imbalance, moe.capacity_factor)
    rows = 0.0
    for S in w.stream_tokens.values():
        own = seqs * local_tokens(plan, S) * moe.top_k / plan.tp
        if moe.capacity_factor and moe.capacity_factor < 1:
            own *= moe.capacity_factor
        rows += len(moe_blocks) * passes * 2 * n * r * own
    gated = getattr(moe, "gates_in_experts", False)
    table = n * (moe.num_experts // plan.ep) * 8 * len(moe_blocks) * len(w.stream_tokens)
    table *= passes - 1
    gates = rows / 2 * 4 if gated else 0.0   # one fp32 per gathered row, each way
    calls = (2 * passes + passes - 1 + (passes if gated else 0)) * len(moe_blocks) * len(w.stream_tokens)
    book("a2a", "etp", (rows * w.model_cfg.d_model * 4 + table + gates) * micro_count(w, plan),
         calls * micro_count(w, plan))


def _context(w, plan, state, book) -> None:
    """Context parallelism (parallel/context/), per attention module and micro-batch, with
    E = b (S/cp) (D/tp) elements of one of q/k/v on this rank: ring: forward 2(cp-1) blocks
    (k, v) sent, backward 4(cp-1) + 2 (k, v, dk, dv; dk, dv on the last hop home), all fp32;
    ulysses: 4 all-to-alls of E (q, k, v, o) forward and 4 backward, in the activation dtype.
    The sequence-wise balance loss sums each sequence's [E+1] statistics over cp (fp32) per
    MoE layer and forward. Recomputation repeats the forward ones."""
    if plan.cp == 1:
        return
    n, m, again = plan.cp, micro_count(w, plan), plan.recompute == "full"
    # one token's key + value heads (repeated to every query head; mla: qk and v widths)
    KV = micro_seqs(w, plan) * local_tokens(plan, w.stream_tokens["decoder"]) * \
        w.model_cfg.attention_score_width() / plan.tp
    layers = len(w.blocks_on(state, plan))
    if plan.cp_mode == "ring":   # a send of k and v per hop forward; k, v, dk, dv backward
        fwd, bwd = (n - 1) * KV * 4, (2 * (n - 1) + 1) * KV * 4
        book("p2p", "cp", (fwd * (1 + again) + bwd) * layers * m,
             ((n - 1) * (1 + again) + n) * layers * m)
    else:  # q, k, v and o: twice the key + value width
        a = act_bytes(plan.precision)
        book("a2a", "cp", (2 * (1 + again) + 2) * KV * a * layers * m,
             4 * (2 + again) * layers * m)
    if w.has_moe() and w.moe_cfg.balance_loss == "sequence":
        moe_layers = sum(w.is_moe_block(i) for i in w.blocks_on(state, plan))
        book("reduce", "cp", _sequence_stats(w, plan, state) * (1 + again) * m,
             moe_layers * (1 + again) * m)


def _sequence_stats(w, plan, state) -> float:
    """Bytes of one forward's sequence balance-loss statistics over the ranks holding parts
    of the sequences ([E+1] fp32 per sequence and MoE layer): 1-D tp's sequence split holds
    every sequence of the micro-batch, the grid's whole-sequence split 1/tp of them."""
    moe_layers = sum(w.is_moe_block(i) for i in w.blocks_on(state, plan))
    seqs = micro_seqs(w, plan) / (plan.tp if plan.tp_mode != "1d" else 1)
    return seqs * (w.moe_cfg.num_experts + 1) * 4 * moe_layers


def _regathered(w, plan, i: int) -> int:
    """Gathers over tp that block i runs again in backward: recompute_modules=layernorm under
    1-D tp keeps the attention's gathered input as the norm's input, gathering it again
    (parallel/output_recompute.py), and a dense FFN's where its readers keep it as it is (the
    stream in the activation dtype; under autocast over an fp32 stream they keep their own
    casts)."""
    if plan.recompute != "selective" or "layernorm" not in plan.recompute_parts or plan.tp_mode != "1d":
        return 0
    dense = not w.is_moe_block(i) and stream_bytes(plan) == act_bytes(plan.precision)
    return 1 + dense


def _tensor(w, plan, state, book, out, events) -> None:
    """DTensor collectives (functional: the ledger books them as tensor_parallel whatever
    else the tp group is) and the MoE layers' own ones on the tp group (classified by the
    group, like any c10d call: with dp=1 the tp group is also the token pool)."""
    if plan.tp == 1:
        return
    a, seqs, tp, m = act_bytes(plan.precision), micro_seqs(w, plan), plan.tp, micro_count(w, plan)
    S, D, V = local_tokens(plan, w.stream_tokens["decoder"]), w.model_cfg.d_model, w.model_cfg.vocab_size
    full, part = seqs * S * D * a, seqs * S * D * a / tp   # the matmul outputs' (a bytes)
    r = stream_bytes(plan)
    full_r, part_r = full * r / a, part * r / a            # the residual stream's and norms'
    dtensor, fwd_only, moe_layers, calls = 0.0, 0.0, 0, 0
    blocks = w.blocks_on(state, plan)
    mtp = set(w.mtp_block_ids())   # an MTP depth's stream starts at eh_proj's output (a bytes)
    for i in blocks:
        # forward: gather the norm's output, reduce-scatter wo's; backward: gather wo's output
        # gradient, reduce-scatter the gathered input's (summed in its dtype, moe/cast_once.py)
        pairs = 1 if w.is_moe_block(i) else 2   # attention; a dense FFN the same again
        g = part if i in mtp else part_r        # the stream's shard and whole
        moe_layers += w.is_moe_block(i)
        fwd_only += pairs * (g + full)
        again_gathered = _regathered(w, plan, i)
        dtensor += pairs * (g + full + part + g * tp) + again_gathered * g
        calls += 4 * pairs + again_gathered
    again = plan.recompute == "full"             # recomputation repeats the forward ones
    if state.first_stage:
        dtensor += full_r                        # vocab-parallel embedding all-reduce
        calls += 1
        book("gather", "tp", part_r * m, m)      # the sequence split's backward
    if state.last_stage:   # head input gather (+ bwd), logits
        dtensor += part_r + full_r + seqs * S * (V / tp) * a
        calls += 3
    depths = len(w.mtp_block_ids()) if state.last_stage else 0
    if depths:  # each MTP depth embeds the tokens ahead and scores through the head, as the ends do
        dtensor += depths * (full_r + part + full + seqs * S * (V / tp) * a)   # embed, head
        calls += 4 * depths
        book("gather", "tp", part_r * m * depths, m * depths)
    if again:
        dtensor += fwd_only
        calls += calls // 2
    dtensor = int(dtensor * m + state.replicated_tp_bytes)
    # each norm weight's gradient (an MTP depth's three norms and projection too)
    calls = calls * m + 2 * len(blocks) + state.last_stage + 4 * depths
    out["tensor_parallel"] += dtensor
    events.append(("tensor_parallel", "reduce_scatter_pair", "tp", tp, dtensor, calls))
    per = moe_layers * m
    if w.moe_whole_sequences():                  # sequence <-> batch all-to-all
        book("a2a", "tp", (4 + 2 * again) * part * per, (4 + 2 * again) * per)
    elif w.has_moe() and w.moe_cfg.balance_loss == "sequence":  # the split's statistics
        book("reduce", "tp", _sequence_stats(w, plan, state) * (1 + again) * m, (1 + again) * per)
    book("reduce", "tp", 4 * (1 + again) * per, (1 + again) * per)   # the MoE aux loss' tp mean


def _grid_tensor(w, plan, state, book) -> None:
    """parallel/tensor/grid.py's collectives (see the module docstring for the terms)."""
    a, m, q, d = act_bytes(plan.precision), micro_count(w, plan), plan.tp_grid, plan.tp_depth
    mc = w.model_cfg
    T = micro_seqs(w, plan) * w.stream_tokens["decoder"] / (d * q)
    D, F, V, r = mc.d_model, mc.d_ff, mc.vocab_size, 4
    norm_ars = 2 if mc.norm == "layernorm" else 1
    fwd, bwd = Counter(), Counter()          # (collective, dim) -> bytes of one micro-batch
    calls = Counter()                        # (collective, dim) -> calls of one micro-batch

    n = [1]                                 # blocks of the kind being counted

    def pair(f, b, f_bytes, b_bytes):       # one forward and one backward collective
        fwd[f] += n[0] * f_bytes
        bwd[b] += n[0] * b_bytes
        calls[f] += n[0]
        calls[b] += n[0]

    def norm():
        pair(("reduce", "tpc"), ("reduce", "tpc"), norm_ars * T * 4, norm_ars * T * 4)

    def gathered(width, nbytes):            # a matmul input [T, width/q] gathered over tpc
        pair(("gather", "tpc"), ("scatter", "tpc"), T * width / q * nbytes, T * width * nbytes)

    def weight(d_in, d_out):                # a weight block gathered over tpr (fp32)
        pair(("gather", "tpr"), ("scatter", "tpr"), d_in * d_out / q ** 2 * 4, d_in * d_out / q * 4)

    def scattered(width, nbytes):           # partial outputs [T, width] reduce-scattered
        pair(("scatter", "tpc"), ("gather", "tpc"), T * width * nbytes, T * width / q * nbytes)

    ids = w.blocks_on(state, plan)
    n_moe = sum(w.is_moe_block(i) for i in ids)
    for is_moe, n[0] in ((True, n_moe), (False, len(ids) - n_moe)):  # each kind's blocks at once
        if not n[0]:
            continue
        norm(), norm()
        gathered(D, r), scattered(D, a)     # q/k/v input, o's partial outputs
        for _ in range(4):
            weight(D, D)
        if is_moe:                          # [T, D/q] -> [T/q, D] and back
            pair(("a2a", "tpc"), ("a2a", "tpc"), 2 * T * D / q * r, 2 * T * D / q * r)
            calls["a2a", "tpc"] += 2 * n[0]
            shared = w.moe_cfg.num_shared_experts * w.expert_d_ff
            if shared:                      # the shared experts: a dense FFN on the grid
                gathered(D, r), scattered(D, a)
                for _ in range(3 if w.gated else 2):
                    weight(D, shared)
        else:
            gathered(D, r), scattered(D, a)   # w1 (w3) input, w2's partial outputs
            for _ in range(3 if w.gated else 2):
                weight(D, F)
    again = plan.recompute == "full"
    blocks = Counter(fwd) if again else Counter()  # recompute repeats them
    fwd_calls = Counter({k: v // 2 for k, v in calls.items()}) if again else Counter()
    n[0] = 1
    if state.first_stage:
        weight(V, D)
        pair(("scatter", "tpc"), ("gather", "tpc"), T * D * 4, T * D / q * 4)
    if state.last_stage:
        norm()
        gathered(D, r)
        weight(V, D)
        for dim, nbytes in (("tpc", T * V / q * a), ("tpr", T * V * a), ("tpd", q * T * V * a)):
            fwd["gather", dim] += nbytes
            calls["gather", dim] += 1
    calls += fwd_calls
    for (collective, dim), nbytes in (fwd + bwd + blocks).items():
        book(collective, dim, nbytes * m, calls[collective, dim] * m)
    for dim, nbytes in state.grid_grad_sums.items():
        book("reduce", dim, nbytes)
    book("reduce", "tp", 4 * (1 + again) * n_moe * m, (1 + again) * n_moe * m)  # aux loss' tp mean
