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
