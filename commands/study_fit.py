"""The scaling study's numbers: per-point results from run directories, the fits, the plot.

Fits (Clark et al., ICML 2022, "Unified Scaling Laws for Routed Language Models"), at the
fixed dense (active) size of the study:
  power       log L = a + b log E
  saturating  log L = a + b log E_hat, 1/E_hat = 1/(E - 1 + 1/(1/E_start - 1/E_max)) + 1/E_max
              (E_start, E_max by grid search, a, b by least squares)
The saturating form has two more parameters: it is reported as the better fit only when its
AIC (n log(SSE/n) + 2k) is lower. Effective dense multiplier of a point: the dense ladder
(the dense model at 1x, 2x, 4x FFN width) fits log L = c + alpha log N_active, over the
smallest sizes up to the first one whose loss does not fall (dense_law); a point's
loss then corresponds to N_eq = exp((log L - c) / alpha) dense active parameters, and the
multiplier is N_eq / (the dense baseline's active parameters). If not even the first step of
the ladder lowers the loss, there is no law and no multiplier.
"""
import json
import math
import statistics
from pathlib import Path


def read_point(run_dir: Path) -> dict:
    """Loss curve and timing of one finished run directory (its metrics.jsonl)."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    steps = {}
    for r in recs:   # a resumed run logs some steps again: the last record of a step wins
        if "step" in r and "loss" in r:
            steps[r["step"]] = r
    rows = [steps[k] for k in sorted(steps)]
    return {"rows": rows,
            "evals": [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None],
            "step_times": [r["step_time_s"] for r in rows]}


def reach(point: dict, target: float, tokens_per_step: int):
    """(steps, tokens, seconds) of the first evaluation at or below target, or Nones."""
    elapsed = 0.0
    times = {r["step"]: r["step_time_s"] for r in point["rows"]}
    for step, val in point["evals"]:
        if val <= target:
            elapsed = sum(t for s, t in times.items() if s <= step)
            return step, step * tokens_per_step, elapsed
    return None, None, None


def _lstsq(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    sse = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, sse


def e_hat(E: float, e_start: float, e_max: float) -> float:
    return 1.0 / (1.0 / (E - 1 + 1.0 / (1.0 / e_start - 1.0 / e_max)) + 1.0 / e_max)


def fit(experts: list, losses: list) -> dict:
    """Both forms on (E, final validation loss); which one the AIC prefers."""
    xs, ys = [math.log(e) for e in experts], [math.log(v) for v in losses]
    a, b, sse = _lstsq(xs, ys)
    n = len(xs)
    out = {"power": {"a": a, "b": b, "sse": sse}}
    best = None
    if n >= 4:
        for e_start in [1.1, 1.5, 2, 3, 4, 6, 8]:
            for e_max in [16, 32, 64, 128, 256, 512, 1024, 4096]:
                if e_max <= e_start:
                    continue
                hx = [math.log(e_hat(e, e_start, e_max)) for e in experts]
                sa, sb, s_sse = _lstsq(hx, ys)
                if best is None or s_sse < best["sse"]:
                    best = {"a": sa, "b": sb, "E_start": e_start, "E_max": e_max, "sse": s_sse}
        out["saturating"] = best

    def aic(sse, k):
        return n * math.log(max(sse, 1e-300) / n) + 2 * k
    out["better"] = "power"
    if best is not None and aic(best["sse"], 4) < aic(sse, 2):
        out["better"] = "saturating"
    return out


def predict(fitted: dict, E: float) -> float:
    f = fitted[fitted["better"]]
    x = math.log(E) if fitted["better"] == "power" else math.log(e_hat(E, f["E_start"], f["E_max"]))
    return math.exp(f["a"] + f["b"] * x)


def dense_law(actives: list, losses: list):
    """(c, alpha, points used) of log L = c + alpha log N over the dense ladder, smallest
    first, up to the first size whose loss does not fall (a larger dense model the step budget
    under-trains says nothing about size); None with fewer than 2 such points."""
    order = sorted(zip(actives, losses))
    used = order[:1]
    for a, b in zip(order, order[1:]):
        if b[1] >= a[1]:
            break
        used.append(b)
    if len(used) < 2:
        return None
    c, alpha, _ = _lstsq([math.log(n) for n, _ in used], [math.log(v) for _, v in used])
    return c, alpha, len(used)


def multiplier(law, loss: float, dense_active: int):
    if law is None or law[1] >= 0:   # a ladder whose loss does not fall with size: no law
        return None
    c, alpha = law[0], law[1]
    return math.exp((math.log(loss) - c) / alpha) / dense_active


def median_step(point: dict) -> float:
    times = point["step_times"][1:] or point["step_times"]   # step 1 pays warm-up
    return statistics.median(times)


def plot(path: Path, points: list, fitted: dict) -> None:
    """study.png: validation loss against tokens per point; final loss against E (log axis)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for p in points:
        xs = [s * p["tokens_per_step"] for s, _ in p["evals"]]
        left.plot(xs, [v for _, v in p["evals"]], marker="o", ms=3, label=p["label"])
    left.set_xlabel("tokens")
    left.set_ylabel("validation loss")
    left.legend(fontsize=8)
    left.set_title("validation loss against tokens")
    routed = [p for p in points if p["kind"] != "dense_ladder"]
    es = [p["experts"] for p in routed]
    right.plot(es, [p["final_val_loss"] for p in routed], "o", label="measured")
    grid = [1 + i * (max(es) - 1) / 100 for i in range(101)] if max(es) > 1 else es
    right.plot(grid, [predict(fitted, e) for e in grid], "-",
               label=f"fit ({fitted['better']}): b={fitted[fitted['better']]['b']:.3f}")
    right.set_xscale("log", base=2)
    right.set_xlabel("experts E (1 = dense, same active size)")
    right.set_ylabel("final validation loss")
    right.legend(fontsize=8)
    right.set_title("final loss against E")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
