"""The load heatmap's colour scale is centred on the uniform share 1/E."""
import numpy as np
import pytest

from moe.profiling import heatmap_figure, save_heatmap


@pytest.mark.parametrize("E", [4, 8, 16])
def test_colour_scale_diverges_at_one_over_E(E):
    rng = np.random.default_rng(E)
    rows = [list(rng.dirichlet(np.ones(E))) for _ in range(3)]
    im = heatmap_figure(rows, [f"layer{i}" for i in range(3)]).axes[0].images[0]
    norm = im.norm
    assert norm.vcenter == pytest.approx(1.0 / E)
    assert norm(1.0 / E) == pytest.approx(0.5)          # uniform = the middle colour
    assert norm.vmin == 0.0 and norm.vmax >= max(max(r) for r in rows)
    assert norm(0.0) == 0.0 and norm(norm.vmax) == 1.0   # idle and busiest at the two ends
    white = im.cmap(0.5)[:3]
    assert min(white) > 0.9                               # a diverging map: near-white centre


def test_skewed_layer_with_dead_expert_saves(tmp_path):
    save_heatmap(str(tmp_path / "load.png"), [[0.7, 0.3, 0.0, 0.0]], ["l0"], dead_rows=[[2, 3]])
    assert (tmp_path / "load.png").stat().st_size > 1000
