"""Expert-load heatmap: one row per MoE layer, one column per expert, colour = share of tokens.

The colour scale diverges at the uniform share 1/E (white): red cells got more than their
share, blue cells less, so over- and under-loaded experts read at a glance.

Shapes: L layers, E experts (layers with fewer experts are padded with blanks).
Drawn with matplotlib's Agg canvas directly (no pyplot, no global backend switch), so it
works headless and inside training processes.
"""
import math

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure


def _short(name: str, limit: int = 28) -> str:
    return name if len(name) <= limit else "..." + name[-(limit - 3):]


def heatmap_figure(share_rows: list, layer_names: list, dead_rows=None, title: str = "") -> Figure:
    """share_rows[l][e]: share of layer l's processed assignments that went to expert e."""
    L = len(share_rows)
    E = max(len(r) for r in share_rows)
    share_LE = np.full((L, E), np.nan)
    for i, row in enumerate(share_rows):
        share_LE[i, :len(row)] = row
    fig = Figure(figsize=(min(max(6.5, 3 + 0.45 * E), 18), min(2.2 + 0.4 * L, 14)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    # 0 .. 1/E .. max (at least 2/E): each side of the uniform share gets half the colour bar
    uniform = 1.0 / E
    vmax = max(2.0 * uniform, float(np.nanmax(share_LE)) if np.isfinite(share_LE).any() else 0.0)
    norm = TwoSlopeNorm(vcenter=uniform, vmin=0.0, vmax=vmax)
    im = ax.imshow(share_LE, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
    cbar = fig.colorbar(im, ax=ax)
    cbar.set_ticks(sorted({0.0, uniform, vmax}))
    cbar.set_label(f"share of tokens\n(white = uniform 1/E = {uniform:.3f};\nred over, blue under)",
                   fontsize=8)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(E))
    ax.set_yticks(range(L))
    ax.set_yticklabels([_short(n) for n in layer_names], fontsize=7)
    dead_cells = {(i, e) for i, dead in enumerate(dead_rows or []) for e in dead}
    if E <= 16 and L <= 24:   # numbers are readable only on small grids
        for (i, e), v in np.ndenumerate(share_LE):
            if math.isfinite(v) and (i, e) not in dead_cells:
                ax.text(e, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=7,
                        color="white" if abs(norm(v) - 0.5) > 0.3 else "black")
    for i, e in dead_cells:
        ax.text(e, i, "x", ha="center", va="center", fontsize=11, color="yellow")
    ax.set_title(title or "expert load (% of tokens; x = dead expert)", fontsize=9)
    fig.tight_layout()
    return fig


def save_heatmap(path: str, share_rows: list, layer_names: list, dead_rows=None,
                 title: str = "") -> None:
    fig = heatmap_figure(share_rows, layer_names, dead_rows, title)
    fig.savefig(path)
