"""Picking images to label (pipeline.evaluate.selection), on planted sets whose answer is known."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import LinearParams, SelectionParams
from pipeline.evaluate import selection as sel
from pipeline.evaluate.features import FeatureSet
from pipeline.evaluate.run.select_labels import measure, pick_all


def _blobs(per_blob: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three tight blobs around orthogonal directions of R^8 (unit rows) and their blob ids."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.eye(8)[:3]
    x = torch.cat([c + 0.05 * torch.randn(per_blob, 8, generator=g) for c in centres])
    return sel.unit_rows(x), torch.arange(3).repeat_interleave(per_blob)


def _all(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bool)


def test_kcenter_and_typical_and_probcover__one_image_per_blob_at_budget_3() -> None:
    x, blob = _blobs()
    kc = sel.pick_kcenter(x, 3, eligible=_all(len(x)))
    ty, clusters = sel.pick_typical(x, 3, eligible=_all(len(x)), seed=0)
    delta = sel.probcover_delta(x, clusters=3, seed=0)
    pc = sel.pick_probcover(x, 3, eligible=_all(len(x)), delta=delta, seed=0)
    for picks in (kc, ty, pc):
        assert sorted(blob[picks].tolist()) == [0, 1, 2]
    assert len(set(clusters)) == 3


def test_random__seeded_nested_and_distinct_per_draw() -> None:
    a = sel.pick_random(100, 10, seed=0, draw=0)
    assert a == sel.pick_random(100, 10, seed=0, draw=0)
    assert a[:5] == sel.pick_random(100, 5, seed=0, draw=0)
    assert a != sel.pick_random(100, 10, seed=0, draw=1)
    assert len(set(a)) == 10


def test_kcenter__farthest_first_order_worked_by_hand() -> None:
    # unit vectors at 0, 10, 90 and 120 degrees: their mean points at 53.9 degrees, closest to
    # 90 (36.1 degrees away): the first pick. Cosine distances from 90: 0 deg 1, 10 deg
    # 1 - cos 80 = 0.83, 120 deg 1 - cos 30 = 0.13: 0 degrees next. Then the nearest-pick
    # distances are 10 deg: 1 - cos 10 = 0.015, 120 deg: 0.13: 120 degrees, then 10 degrees.
    deg = torch.tensor([0.0, 10.0, 90.0, 120.0]) * math.pi / 180
    x = torch.stack([deg.cos(), deg.sin()], dim=1)
    assert sel.pick_kcenter(x, 4, eligible=_all(4)) == [2, 0, 3, 1]


def test_outliers_are_not_picked_and_duplicates_not_twice() -> None:
    x, _ = _blobs()
    far = sel.unit_rows(torch.eye(8)[7:8])  # a lone image: k-center's second pick
    dup = x[:1].clone()  # an exact copy of row 0
    xs = torch.cat([x, far, dup])
    n = len(xs)
    assert n - 2 in sel.pick_kcenter(xs, 4, eligible=_all(n))
    score = torch.zeros(n)
    score[n - 2] = 10.0
    ok = sel.eligible_mask(n, outlier_score=score, exclude_outliers=1 / n)
    assert ok.sum() == n - 1 and not ok[n - 2]
    pairs = torch.tensor([[0, n - 1]])
    for picks in (sel.pick_kcenter(xs, 20, eligible=ok, pairs=pairs),
                  sel.pick_typical(xs, 20, eligible=ok, seed=0, pairs=pairs)[0],
                  sel.pick_probcover(xs, 20, eligible=ok, seed=0, pairs=pairs,
                                     delta=sel.probcover_delta(xs, clusters=3, seed=0))):
        assert n - 2 not in picks
        assert not {0, n - 1} <= set(picks)
        assert len(set(picks)) == len(picks) == 20


def test_typicality__matches_a_brute_force_reference() -> None:
    x, _ = _blobs(per_blob=15)
    d = torch.cdist(x.double(), x.double())
    d.fill_diagonal_(float("inf"))
    want = 1 / d.topk(5, dim=1, largest=False).values.mean(dim=1)
    assert torch.allclose(sel._typicality(x, 5).double(), want, rtol=1e-4)


def test_typicality__past_the_threshold_on_the_graph_matches_the_reference(monkeypatch) -> None:
    import pipeline.evaluate.ann as ann

    x, _ = _blobs(per_blob=200, seed=3)
    d = torch.cdist(x.double(), x.double())
    d.fill_diagonal_(float("inf"))
    want = 1 / d.topk(20, dim=1, largest=False).values.mean(dim=1)
    monkeypatch.setattr(ann, "EXACT_SEARCH_MAX_PAIRS", 0)  # every cluster on its HNSW graph
    import pipeline.evaluate.knn as knn

    graphs = []
    monkeypatch.setattr(knn, "hnsw_index", lambda bank: graphs.append(1) or ann.hnsw_index(bank))
    got = sel._typicality(x, 20).double()
    assert graphs == [1]
    assert torch.allclose(got, want, rtol=1e-3)
    assert got.argmax() == want.argmax()  # the pick: the most typical row


def test_ball_graph_and_delta__match_brute_force() -> None:
    x, _ = _blobs(per_blob=20)
    d = torch.cdist(x.double(), x.double())
    delta = float(d[d > 0].median())
    offsets, members = sel.ball_graph(x, delta)
    for i in range(len(x)):
        got = members[offsets[i]:offsets[i + 1]].tolist()
        assert got == torch.nonzero(d[i] <= delta).flatten().tolist()
    # delta: with every image sampled, the 5 % quantile of the distance to the nearest image
    # of another k-means cluster
    labels = sel.kmeans(x, 3, seed=0)
    other = torch.where(labels.unsqueeze(1) != labels.unsqueeze(0), d, torch.inf).min(dim=1)
    want = float(torch.quantile(other.values.float(), 0.05))
    assert sel.probcover_delta(x, clusters=3, seed=0, sample=len(x)) == pytest.approx(want,
                                                                                     rel=1e-4)


def test_probcover__greedy_max_coverage_worked_by_hand() -> None:
    # five points on a line (2-d unit circle, small angles): balls of radius covering the
    # neighbours at 1 degree: ball(1) = {0, 1, 2}, ball(3) = {2, 3, 4}; the first pick covers 3,
    # row 1 (the lower of the two), then row 3 covers {3, 4}: 2 new, more than any other
    deg = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]) * math.pi / 180
    x = torch.stack([deg.cos(), deg.sin()], dim=1)
    delta = 2 * math.sin(math.radians(1.2) / 2)  # chord of 1.2 degrees
    assert sel.pick_probcover(x, 2, eligible=_all(5), delta=delta, seed=0) == [1, 3]


def test_pick_all_and_measure__blob_labels_give_perfect_knn() -> None:
    x, blob = _blobs()
    keys = [f"k{i}" for i in range(len(x))]
    data = {"features": x, "keys": keys, "where": ["s"] * len(x),
            "outlier_score": torch.zeros(len(x)), "pairs": torch.zeros(0, 2, dtype=torch.long)}
    p = SelectionParams(budget=[3], method="typical", compare=["random", "kcenter", "typical"],
                        draws=2, exclude_outliers=0.0)
    picks, info = pick_all(data, p, seed=0)
    assert set(picks) == {"random", "kcenter", "typical"} and len(picks["random"][3]) == 2
    train = FeatureSet(x, blob, keys)
    xt, bt = _blobs(per_blob=10, seed=1)
    test = FeatureSet(xt, bt, [f"t{i}" for i in range(len(xt))])
    out = measure({m: picks[m] for m in ("kcenter", "typical")}, keys, train, test,
                  linear=LinearParams(epochs=5), seed=0, device=torch.device("cpu"))
    for m in ("kcenter", "typical"):
        assert out[m]["3"]["knn"]["mean"] == 100.0  # one labelled image per blob, blobs apart
        assert out[m]["3"]["classes"]["mean"] == 3.0


def test_budget_above_the_images__refused() -> None:
    with pytest.raises(Exception, match="budget 300 is more than the 120"):
        sel.check_budgets([10, 300], 120)


def test_pick_all__budget_above_the_images_left_after_outliers__refused_naming_the_key() -> None:
    x, _ = _blobs(per_blob=10)  # 30 images; exclude 20 % -> 24 left
    data = {"features": x, "keys": [f"k{i}" for i in range(30)], "where": ["s"] * 30,
            "outlier_score": torch.arange(30.0), "pairs": torch.zeros(0, 2, dtype=torch.long)}
    p = SelectionParams(budget=[5, 25], exclude_outliers=0.2)
    with pytest.raises(Exception, match=r"selection.budget: budget 25 is more than the 24 images "
                                        r"left to pick from: 30 pretraining images"):
        pick_all(data, p, seed=0)


def test_pick_all__near_duplicates_leave_fewer_picks__recorded_not_hidden() -> None:
    # four images, two exact pairs: k-center can pick one of each pair, two of a budget of 4
    x = sel.unit_rows(torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]))
    data = {"features": x, "keys": list("abcd"), "where": ["s"] * 4,
            "outlier_score": torch.zeros(4), "pairs": torch.tensor([[0, 1], [2, 3]])}
    p = SelectionParams(budget=[2, 4], method="kcenter", compare=["kcenter"], draws=1,
                        exclude_outliers=0.0)
    picks, info = pick_all(data, p, seed=0)
    assert sorted(picks["kcenter"][4][0]) in ([0, 2], [0, 3], [1, 2], [1, 3])
    assert info["short"] == {"kcenter": {"4": 2}}
