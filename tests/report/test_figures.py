import numpy as np
from PIL import Image
from reporthelpers import CLASS_NAMES, features

from pipeline.report import figures as fg


def test_seeded_subsample__distinct_sorted_reproducible():
    a = fg.seeded_subsample(100, 10, seed=5)
    assert len(set(a.tolist())) == 10 and a.tolist() == sorted(a.tolist())
    assert a.tolist() == fg.seeded_subsample(100, 10, seed=5).tolist()
    assert fg.seeded_subsample(4, 10, seed=5).tolist() == [0, 1, 2, 3]


def test_plot_tsne__skipped_below_minimum(tmp_path):
    feats, labels = features(30, 0)
    assert (
        fg.plot_tsne(feats, labels, CLASS_NAMES, tmp_path / "t.png", num_points=0, seed=0) is None
    )
    assert (
        fg.plot_tsne(feats, labels, CLASS_NAMES, tmp_path / "t.png", num_points=9, seed=0) is None
    )
    assert not (tmp_path / "t.png").exists()


def test_plot_per_class_accuracy__class_absent_from_test_set(tmp_path):
    # a class absent from the test set has no accuracy (NaN): no bar, still a valid PNG
    path = fg.plot_per_class_accuracy(
        CLASS_NAMES, {"kNN": [70.0, float("nan"), 60.0]}, tmp_path / "p.png"
    )
    with Image.open(path) as png:
        png.load()  # decodes every byte: a truncated or broken file raises here
        # 3 classes: width max(6, 0.6 * 3 + 2) = 6 in, height 4 in, at the module's DPI
        assert (png.format, png.size) == ("PNG", (6 * fg.DPI, 4 * fg.DPI))


def _drawn(monkeypatch, draw):
    """The matplotlib Figure that ``draw()`` saves (fg._save wrapped to keep it)."""
    figs = []
    save = fg._save
    monkeypatch.setattr(fg, "_save", lambda fig, path: (figs.append(fig), save(fig, path))[1])
    draw()
    (fig,) = figs
    return fig


def test_plot_knn_monitor__dashed_line_is_the_monitors_own_epoch_zero(tmp_path, monkeypatch):
    # epoch 0 of plots/knn_monitor.tsv is the random init on the monitor's features and images
    table = {"epoch": np.array([0.0, 1.0, 2.0]), "knn_top1": np.array([69.55, 74.75, 78.5])}
    fig = _drawn(monkeypatch, lambda: fg.plot_knn_monitor(table, tmp_path / "k.png"))
    (ax,) = fig.axes
    dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert [list(ln.get_ydata()) for ln in dashed] == [[69.55, 69.55]]  # only it: no baselines
    assert "same features and images: 69.55" in dashed[0].get_label()
    assert fg.epoch_zero(table, "knn_top1") == 69.55
    assert fg.epoch_zero({"epoch": np.array([1.0]), "knn_top1": np.array([7.0])},
                         "knn_top1") is None  # no epoch-0 row: no reference drawn


def test_plot_label_efficiency__equal_stars_stay_side_by_side(tmp_path, monkeypatch):
    from matplotlib.lines import Line2D

    from pipeline.report.quality import plot_label_efficiency

    pt = {"mean": 50.0, "std": 1.0}
    curve = {kind: {probe: {"1": pt, "10": pt, "100": pt} for probe in ("knn", "linear")}
             for kind in ("moco", "raw_pixels", "random_encoder")}
    # the default run: MoCo 87.01 and raw pixels 87.16 with every label, ~1 px apart in y
    alls = {("moco", "knn"): 87.01, ("raw_pixels", "knn"): 87.16,
            ("random_encoder", "knn"): 78.36, ("moco", "linear"): 90.37,
            ("raw_pixels", "linear"): 90.37}  # identical numbers: the worst case
    fig = _drawn(monkeypatch, lambda: plot_label_efficiency(curve, alls, 6000.0,
                                                            tmp_path / "le.png"))
    fig.canvas.draw()
    for ax, n_stars in zip(fig.axes[:2], (3, 2)):
        stars = [ln for ln in ax.get_lines() if isinstance(ln, Line2D) and ln.get_marker() == "*"]
        assert len(stars) == n_stars
        xy = [ln.get_transform().transform(ln.get_xydata())[0] for ln in stars]  # pixels
        size_px = stars[0].get_markersize() * fig.dpi / 72
        box = ax.bbox  # every whole star inside the axes (clipped otherwise)
        assert all(box.x0 + size_px / 2 <= x <= box.x1 - size_px / 2
                   and box.y0 + size_px / 2 <= y <= box.y1 - size_px / 2 for x, y in xy), (box, xy)
        for i in range(len(xy)):
            for j in range(i + 1, len(xy)):
                assert np.hypot(*(xy[i] - xy[j])) >= size_px, (i, j, xy)
