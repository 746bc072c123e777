"""The label-efficiency curve: draws, probes on a few labels, the stage on real shards."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import build_tiny_shards, run_pretrain

from pipeline.config import LinearParams
from pipeline.evaluate.features import FeatureSet
from pipeline.evaluate.label_efficiency import curve, draw_per_class


def test_draw_per_class__n_per_class_seeded_and_independent_draws():
    labels = torch.tensor([0] * 10 + [1] * 10 + [2] * 3 + [-1] * 5)
    a = draw_per_class(labels, 4, seed=0, draw=0)
    assert a == sorted(a) and len(a) == 4 + 4 + 3  # class 2 has only 3: all of them
    assert [int(labels[i]) for i in a].count(0) == 4 and not any(labels[i] < 0 for i in a)
    assert draw_per_class(labels, 4, seed=0, draw=0) == a  # reproducible
    assert draw_per_class(labels, 4, seed=0, draw=1) != a  # another draw
    with pytest.raises(ValueError, match=">= 1"):
        draw_per_class(labels, 0, seed=0, draw=0)


def _hand_knn(bank_x, bank_y, query_x, query_y, k, T, classes):
    """Weighted kNN by a double loop: cosine, the k most similar, votes exp(s / T)."""
    norm = [v / v.norm() for v in bank_x.double()]
    correct = 0
    for q, y in zip(query_x.double(), query_y.tolist()):
        q = q / q.norm()
        sims = sorted(((float(q @ b), int(c)) for b, c in zip(norm, bank_y)), reverse=True)[:k]
        votes = [0.0] * classes
        for s, c in sims:
            votes[c] += math.exp(s / T)
        correct += int(max(range(classes), key=lambda c: (votes[c], -c)) == y)
    return 100.0 * correct / len(query_y)


def test_curve__knn_points_against_a_double_loop_reference():
    g = torch.Generator().manual_seed(0)
    train_y = torch.arange(40) % 4
    test_y = torch.arange(20) % 4
    centre = torch.randn(4, 6, generator=g)
    train_x = centre[train_y] + 0.9 * torch.randn(40, 6, generator=g)
    test_x = centre[test_y] + 0.9 * torch.randn(20, 6, generator=g)
    train = FeatureSet(train_x, train_y, [f"t{i}" for i in range(40)])
    test = FeatureSet(test_x, test_y, [f"q{i}" for i in range(20)])
    lin = LinearParams(epochs=5, lr_milestones=[3, 4])
    out = curve({"x": lambda idx: train.subset(idx)}, {"x": test}, train_y, per_class=[1, 3],
                draws=3, seed=7, num_classes=4, linear=lin, device=torch.device("cpu"))
    for n in (1, 3):
        expected = []
        for d in range(3):
            rows = draw_per_class(train_y, n, seed=7, draw=d)
            expected.append(_hand_knn(train_x[rows], train_y[rows], test_x, test_y,
                                      k=min(200, len(rows)), T=0.1, classes=4))
        point = out["x"]["knn"][str(n)]
        assert point["mean"] == pytest.approx(sum(expected) / 3, abs=1e-3)
        assert point["min"] == pytest.approx(min(expected)) and point["max"] == pytest.approx(
            max(expected))
        assert 0 <= out["x"]["linear"][str(n)]["mean"] <= 100


def test_curve__points_say_what_they_used_and_a_repeat_is_left_out(caplog):
    # classes of 10, 10 and 3 labelled images: 2/class uses 6; 5/class asks 15 but class 2
    # gives its 3 (13 in all); 10/class uses 23; 20/class would be 10/class's images again
    labels = torch.tensor([0] * 10 + [1] * 10 + [2] * 3 + [-1] * 5)
    feats = FeatureSet(torch.randn(28, 4, generator=torch.Generator().manual_seed(0)), labels,
                       [f"k{i}" for i in range(28)])
    test = FeatureSet(feats.features[:23], labels[:23], [f"q{i}" for i in range(23)])
    out = curve({"x": lambda idx: feats.subset(idx)}, {"x": test}, labels,
                per_class=[2, 5, 10, 20], draws=1, seed=0, num_classes=3,
                linear=LinearParams(epochs=1, lr_milestones=[1]), device=torch.device("cpu"))
    knn = out["x"]["knn"]
    assert list(knn) == ["2", "5", "10"]  # 20 left out: the same 23 images as 10
    assert [(knn[n]["labels"], knn[n]["per_class_min"]) for n in knn] == [(6, 2), (13, 3),
                                                                            (23, 3)]
    assert "20 per class left out" in caplog.text and "5 per class asked" in caplog.text


def test_label_efficiency_stage__three_kinds_same_draws(tmp_path):
    from pipeline.evaluate.run.embed import embed
    from pipeline.evaluate.run.label_efficiency import label_efficiency

    shards = build_tiny_shards(tmp_path / "s", n_train=96, n_test=48)
    run_pretrain(shards, tmp_path, {"pretrain": {"epochs": 1}})
    embed(encoder_path=tmp_path / "encoder.pt", shards_dir=shards, out_dir=tmp_path / "f",
          batch_size=64)
    from helpers import TINY

    from pipeline.config import from_dict

    p = from_dict(TINY)
    m = label_efficiency(features_dir=tmp_path / "f", shards_dir=shards, model=p.model, seed=0,
                         linear=LinearParams(epochs=3, lr_milestones=[2]), per_class=[1, 5],
                         draws=2, layer=4, pool_grid=1)
    assert sorted(m["curve"]) == ["moco", "random_encoder", "raw_pixels"]
    assert m["train_images"] == 96 and m["draws"] == 2
    for kind in m["curve"].values():
        for probe in ("knn", "linear"):
            assert sorted(kind[probe]) == ["1", "5"]
            assert all(0 <= kind[probe][n]["min"] <= kind[probe][n]["max"] <= 100
                       for n in ("1", "5"))
    # the synthetic classes differ by a bright quadrant: raw pixels with 5 labels per class
    # (20 images) separate them almost perfectly
    assert m["curve"]["raw_pixels"]["knn"]["5"]["mean"] > 90


def test_write_label_efficiency__headline_points_curve_rows_in_numeric_order(tmp_path):
    import csv
    import json

    from pipeline.evaluate.run.label_efficiency import write_label_efficiency

    def pt(mean, n):  # 10 classes, each holding every label asked
        return {"mean": mean, "std": 1.5, "min": mean - 2, "max": mean + 2,
                "labels": 10 * int(n), "per_class_min": int(n)}

    ns = ["1", "10", "100", "2"]  # the text order json.dumps(sort_keys=True) writes them in
    curve = {kind: {probe: {n: pt(base + int(n) / 4 + (probe == "linear"), n) for n in ns}
                    for probe in ("knn", "linear")}
             for kind, base in (("moco", 50), ("raw_pixels", 40), ("random_encoder", 30))}
    result = {"draws": 3, "train_images": 600, "curve": curve, "wall_time_s": 12.5}
    paths = {k: tmp_path / f for k, f in (("metrics_path", "m.json"),
                                          ("details_path", "d.json"), ("plots_path", "p.tsv"))}
    write_label_efficiency(result, **paths)
    # MoCo's means at 1 and 10 labels per class (50 + n/4, +1 for linear), nothing else
    assert json.loads(paths["metrics_path"].read_text()) == {
        "knn": {"1": 50.25, "10": 52.5}, "linear": {"1": 51.25, "10": 53.5},
        "wall_time_s": 12.5}
    assert json.loads(paths["details_path"].read_text()) == result
    with open(paths["plots_path"]) as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    assert list(rows[0]) == ["per_class", "features", "probe", "top1", "top1_min", "top1_max",
                             "labels"]
    assert [int(r["per_class"]) for r in rows] == [1] * 6 + [2] * 6 + [10] * 6 + [100] * 6
    at100 = {(r["features"], r["probe"]): (r["top1"], r["top1_min"], r["top1_max"])
             for r in rows if r["per_class"] == "100"}
    assert at100[("raw_pixels", "linear")] == ("66", "64", "68")  # 40 + 25 + 1, -2, +2
    assert {r["labels"] for r in rows if r["per_class"] == "100"} == {"1000"}
