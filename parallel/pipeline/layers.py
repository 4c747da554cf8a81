"""Which transformer blocks each pipeline stage holds: `parallel.pp_layers`.

    ""          even: n_layers / num_stages blocks per stage (must divide)
    "3,4,4,3"   explicit: blocks per stage, num_stages entries summing to n_layers
    "auto"      balanced: contiguous blocks chosen to minimise the heaviest stage, where a
                stage weighs max(its time / the mean stage time, its parameters / the mean
                stage parameters) -- so the embedding (stage 0) and the output head and loss
                (last stage) count, and MoE blocks weigh more than dense ones

ParallelPlan.validate resolves "" and "auto" into the explicit form (pure arithmetic on
the model config), so the split, the planner and checkpoints read one list.

Per-block cost model (GPT blocks of models/gpt.py; D model dim, F dense d_ff, F_e expert
d_ff, g = 3 gated / 2 otherwise, E experts, K top-k, N shared experts, V vocabulary,
S tokens per sequence):
  parameters   attention 4 D^2; dense FFN g D F; MoE FFN E g D F_e + D E + N g D F_e
  time         2 x (matmul weights a token passes: attention 4 D^2, FFN g D F or
               K g D F_e + D E + N g D F_e) + 4 S D (scores and values), per token
  ends         stage 0: the embedding V D parameters (no matmul); last stage: the head,
               2 V D per token and V D parameters (untied), plus 3 V per token for the loss,
               and each multi-token prediction depth (model.mtp_depth): a block as the last
               one, its projection 2 D^2 and the head and loss once more
tests/unit/test_pp_layers.py checks these parameter counts against the built model.
"""

__all__ = ["parse", "resolve", "stage_blocks", "block_weights", "balanced"]


def parse(spec: str) -> object:
    """None (even), "auto", or [blocks per stage]; ValueError naming the field otherwise."""
    text = str(spec).strip().lower()
    if text in ("", "even"):
        return None
    if text == "auto":
        return "auto"
    try:
        counts = [int(c) for c in text.replace(" ", "").split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0 or 0 in counts[1:-1] or len(counts) < 2 or not any(counts):
        raise ValueError(f"parallel.pp_layers={spec!r} must be '' (even), 'auto' or a comma list "
                         f"of blocks per stage, each >= 1 but the first and the last, which may be "
                         f"0 (the embedding, or the head and loss, alone: e.g. '0,4,4,3')")
    return counts


def block_weights(model_cfg, moe_cfg, seq_len: int) -> tuple:
    """([time per block], [parameters per block], (embedding params), (head time, head
    params)) in the units of the module docstring (per token, elements)."""
    D, F, V = model_cfg.d_model, model_cfg.d_ff, model_cfg.vocab_size
    from moe.experts import ACTIVATIONS
    g = 3 if ACTIVATIONS.get(model_cfg.activation, (None, False))[1] else 2
    attention = model_cfg.attention_params()
    times, params = [], []
    for i in range(model_cfg.n_layers):
        if moe_cfg is not None and moe_cfg.enabled and moe_cfg.is_moe_block(i):
            Fe, E = moe_cfg.d_ff or F, moe_cfg.num_experts
            shared = moe_cfg.num_shared_experts * g * D * Fe
            passed, held = moe_cfg.top_k * g * D * Fe + D * E + shared, E * g * D * Fe + D * E + shared
        else:
            passed = held = g * D * F
        times.append(2 * (attention + passed) + 2 * seq_len * model_cfg.attention_score_width())
        params.append(attention + held)
    head_params = 0 if model_cfg.tie_embeddings else V * D
    K = getattr(model_cfg, "mtp_depth", 0)  # the depths sit with the head (pipeline/mtp.py)
    head_time = 2 * V * D + 3 * V + K * (times[-1] + 2 * 2 * D * D + 2 * V * D + 3 * V)
    return times, params, V * D, (head_time, head_params + K * (params[-1] + 2 * D * D))


def balanced(times, params, num_stages: int, first=(0, 0), last=(0, 0)) -> list:
    """Blocks per stage (contiguous) minimising the heaviest stage's weight, a stage weighing
    max(time / mean time, params / mean params); first/last = (time, params) the first and
    last stages add. Exact: dynamic programming over split points (O(S n^2))."""
    n = len(times)
    if n < num_stages:
        raise ValueError(f"{n} blocks cannot fill {num_stages} pipeline stages")
    t_mean = (sum(times) + first[0] + last[0]) / num_stages or 1.0
    p_mean = (sum(params) + first[1] + last[1]) / num_stages or 1.0
    t_pre, p_pre = [0.0], [0.0]
    for t, p in zip(times, params):
        t_pre.append(t_pre[-1] + t)
        p_pre.append(p_pre[-1] + p)

    def weight(s, a, b):  # stage s holds blocks [a, b)
        t, p = t_pre[b] - t_pre[a], p_pre[b] - p_pre[a]
        if s == 0:
            t, p = t + first[0], p + first[1]
        if s == num_stages - 1:
            t, p = t + last[0], p + last[1]
        return max(t / t_mean, p / p_mean)

    inf = float("inf")
    # best[s][b]: the smallest heaviest weight of stages 0..s holding blocks [0, b)
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for b in range(1, n + 1):
        best[0][b] = weight(0, 0, b)
    for s in range(1, num_stages):
        for b in range(s + 1, n + 1):
            for a in range(s, b):
                w = max(best[s - 1][a], weight(s, a, b))
                if w < best[s][b] - 1e-12:
                    best[s][b], cut[s][b] = w, a
    counts, b = [], n
    for s in range(num_stages - 1, 0, -1):
        a = cut[s][b]
        counts.append(b - a)
        b = a
    counts.append(b)
    return counts[::-1]


def resolve(spec: str, num_stages: int, model_cfg, moe_cfg, seq_len) -> str:
    """The explicit "c0,c1,..." form of `spec` for this model (ValueError naming the field)."""
    n = model_cfg.n_layers
    parsed = parse(spec)
    if parsed is None:
        if n % num_stages:
            raise ValueError(f"model.n_layers={n} is not divisible by the {num_stages} pipeline "
                             f"stages; set parallel.pp_layers=auto (balanced by time and memory) "
                             f"or list the blocks per stage, e.g. parallel.pp_layers="
                             f"{_example(n, num_stages)}")
        counts = [n // num_stages] * num_stages
    elif parsed == "auto" and n < num_stages:
        counts = ends_alone(n, num_stages)
    elif parsed == "auto":
        times, params, embed, (head_t, head_p) = block_weights(
            model_cfg, moe_cfg, seq_len or model_cfg.max_seq_len)
        counts = balanced(times, params, num_stages, (0, embed), (head_t, head_p))
    else:
        counts = parsed
        if len(counts) != num_stages or sum(counts) != n:
            raise ValueError(f"parallel.pp_layers={spec!r} lists {len(counts)} stages holding "
                             f"{sum(counts)} blocks; the layout has {num_stages} stages and "
                             f"model.n_layers={n}: give {num_stages} counts summing to {n}")
    return ",".join(str(c) for c in counts)


def ends_alone(n: int, num_stages: int) -> list:
    """auto with fewer blocks than stages: Megatron's account-for-embedding / -loss split,
    the ends counted as stages of their own: one block a stage, the head and loss alone on
    the last stage (one block short), the embedding alone on the first too (two short)."""
    if n < num_stages - 2:
        raise ValueError(f"parallel.pp_layers=auto: model.n_layers={n} blocks cannot fill "
                         f"{num_stages} pipeline stages, even with the embedding and the head "
                         f"and loss as stages of their own; lower parallel.pp")
    return ([0] if n == num_stages - 2 else []) + [1] * n + [0]


def _example(n: int, k: int) -> str:
    base, extra = divmod(n, k)
    return ",".join(str(base + (1 if s < extra else 0)) for s in range(k))


def stage_blocks(pp_layers: str, n_layers: int, num_stages: int) -> list:
    """[[block ids] per stage] of a resolved (or even) pp_layers."""
    parsed = parse(pp_layers)
    if parsed == "auto":
        raise ValueError("parallel.pp_layers=auto is resolved by ParallelPlan.validate with the "
                         "model config: call plan.validate(world, model_cfg, moe_cfg) first")
    counts = parsed or [n_layers // num_stages] * num_stages
    if len(counts) != num_stages or sum(counts) != n_layers:
        raise ValueError(f"parallel.pp_layers={pp_layers!r} does not fit {num_stages} stages of "
                         f"{n_layers} blocks")
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out
