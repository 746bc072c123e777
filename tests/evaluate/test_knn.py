import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.data.manifest import Manifest
from pipeline.evaluate.knn import knn_classify, knn_predict
from pipeline.evaluate.metrics import classification_metrics


def _reference_scores(train, labels, test, k, T, num_classes):
    """Slow, obviously-correct kNN: a Python loop over test points, float64, full sort."""
    train = F.normalize(train.double(), dim=1)
    out = torch.zeros(len(test), num_classes, dtype=torch.float64)
    for r, q in enumerate(F.normalize(test.double(), dim=1)):
        sims = [(float(q @ x), int(y)) for x, y in zip(train, labels)]
        sims.sort(key=lambda t: -t[0])
        for s, y in sims[: min(k, len(sims))]:
            out[r, y] += math.exp(s / T)
        out[r] /= out[r].sum()
    return out


def _random_problem(seed, n=300, m=40, d=16, c=5):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(c, d, generator=g)
    y_tr = torch.randint(0, c, (n,), generator=g)
    y_te = torch.randint(0, c, (m,), generator=g)
    x_tr = centres[y_tr] + 1.5 * torch.randn(n, d, generator=g)
    x_te = centres[y_te] + 1.5 * torch.randn(m, d, generator=g)
    return x_tr, y_tr, x_te, y_te


# Hand-worked example, query q = (1, 0):
#   x0 = (0.8,  0.6) class 0  -> cosine 0.8
#   x1 = (0.6,  0.8) class 1  -> cosine 0.6
#   x2 = (0.6, -0.8) class 1  -> cosine 0.6
#   x3 = (-1,   0)   class 2  -> cosine -1
# k = 3 keeps x0, x1, x2.  Votes: class 0 = e^(0.8/T), class 1 = 2 e^(0.6/T).
#   T = 0.1: shares 1 / (1 + 2 e^-2)   = 1 / 1.2706706 = 0.786986 (class 0 wins, the minority)
#   T = 1:   shares 1 / (1 + 2 e^-0.2) = 1 / 2.6374615 = 0.379153 (class 1 wins, the majority)
HAND_TRAIN = torch.tensor([[0.8, 0.6], [0.6, 0.8], [0.6, -0.8], [-1.0, 0.0]])
HAND_LABELS = torch.tensor([0, 1, 1, 2])
HAND_QUERY = torch.tensor([[1.0, 0.0]])


def test_knn_predict__hand_computed_weighted_votes():
    s = knn_predict(HAND_TRAIN, HAND_LABELS, HAND_QUERY, k=3, T=0.1)
    assert s.shape == (1, 3)
    torch.testing.assert_close(s[0], torch.tensor([0.786986, 0.213014, 0.0]), atol=1e-5, rtol=0)
    s = knn_predict(HAND_TRAIN, HAND_LABELS, HAND_QUERY, k=3, T=1.0)
    torch.testing.assert_close(s[0], torch.tensor([0.379153, 0.620847, 0.0]), atol=1e-5, rtol=0)
    # scale does not matter (cosine): the same bank scaled by 7 gives the same scores
    s7 = knn_predict(7 * HAND_TRAIN, HAND_LABELS, 3 * HAND_QUERY, k=3, T=1.0)
    torch.testing.assert_close(s7, s, atol=1e-6, rtol=0)


def test_knn_predict__k_larger_than_bank(caplog):
    # k = 200 > N = 4 uses all 4 neighbours: x3 adds e^(-1/0.1) to class 2, a share of
    # e^-10 / (e^8 + 2 e^6 + e^-10) = e^-18 / 1.2706706 = 1.199e-8.
    with caplog.at_level("WARNING"):
        s = knn_predict(HAND_TRAIN, HAND_LABELS, HAND_QUERY, k=200, T=0.1)
    assert "k = 200 exceeds the 4 labelled bank rows" in caplog.text  # said, not silent
    torch.testing.assert_close(s, knn_predict(HAND_TRAIN, HAND_LABELS, HAND_QUERY, k=4, T=0.1))
    assert s[0, 2].item() == pytest.approx(1.199e-8, rel=1e-2)
    r = knn_classify(HAND_TRAIN, HAND_LABELS, HAND_QUERY, torch.tensor([0]), k=200)
    assert (r.k, r.k_used, r.top1) == (200, 4, 100.0)


def test_knn_classify__tie_goes_to_lowest_label():
    # q = (1, 0); (0.6, 0.8) label 9 and (0.6, -0.8) label 4 have bit-identical cosine 0.6,
    # so with k = 2 both classes get exactly half the vote; label 0 at (-1, 0) gets nothing.
    # The lowest tied label (4) must win whatever the bank order.
    x = torch.tensor([[0.6, 0.8], [0.6, -0.8], [-1.0, 0.0]])
    y = torch.tensor([9, 4, 0])
    for order in ([0, 1, 2], [1, 0, 2], [2, 0, 1]):
        r = knn_classify(x[order], y[order], HAND_QUERY, torch.tensor([9]), k=2, T=0.1)
        assert r.predictions.tolist() == [4]
        assert r.top1 == 0.0
        assert (r.top5_k, r.top5) == (3, 100.0)
    s = knn_predict(x, torch.tensor([2, 1, 0]), HAND_QUERY, k=2)
    assert s[0, 1].item() == s[0, 2].item() == 0.5


def test_classification_metrics__top5_ranking_and_ties_by_hand():
    classes = torch.arange(7)
    # row 0: target 0 has the 6th largest score -> top-5 miss; row 1: target 1 is 5th -> hit
    row = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.05])
    m = classification_metrics(torch.stack([row, row]), torch.tensor([0, 1]), classes)
    assert (m.top1, m.top5, m.top5_k) == (0.0, 50.0, 5)
    assert m.predictions.tolist() == [5, 5]
    # all scores tied: ranking is 0, 1, 2, ... so class 4 is in the top 5 and class 5 is not
    flat = torch.ones(2, 6)
    m = classification_metrics(flat, torch.tensor([4, 5]), torch.arange(6))
    assert (m.top1, m.top5) == (0.0, 50.0)
    assert m.predictions.tolist() == [0, 0]


def test_knn_predict__matches_slow_reference():
    x_tr, y_tr, x_te, _ = _random_problem(0)
    ref = _reference_scores(x_tr, y_tr, x_te, k=20, T=0.1, num_classes=5)
    got = knn_predict(x_tr, y_tr, x_te, k=20, T=0.1, chunk_size=7, bank_chunk_size=64)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=0)
    assert torch.equal(got.argmax(1), ref.argmax(1))


def test_knn_predict__chunk_size_one_equals_large():
    x_tr, y_tr, x_te, _ = _random_problem(1)
    big = knn_predict(x_tr, y_tr, x_te, k=15, chunk_size=1024)
    one = knn_predict(x_tr, y_tr, x_te, k=15, chunk_size=1)
    torch.testing.assert_close(one, big, atol=1e-6, rtol=0)


def test_knn_predict__bank_chunked_equals_unchunked():
    x_tr, y_tr, x_te, _ = _random_problem(2)
    whole = knn_predict(x_tr, y_tr, x_te, k=25, bank_chunk_size=10**6)
    for bank_chunk in (1, 7, 25, 100):  # smaller than, equal to and larger than k
        part = knn_predict(x_tr, y_tr, x_te, k=25, chunk_size=9, bank_chunk_size=bank_chunk)
        torch.testing.assert_close(part, whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("m", [1, 3])
def test_knn_classify__tiny_test_sets(m):
    x_tr, y_tr, x_te, y_te = _random_problem(3)
    ref = _reference_scores(x_tr, y_tr, x_te[:m], k=200, T=0.1, num_classes=5)
    r = knn_classify(x_tr, y_tr, x_te[:m], y_te[:m], chunk_size=1024)
    assert r.predictions.tolist() == ref.argmax(1).tolist()
    expected = 100.0 * (ref.argmax(1) == y_te[:m]).double().mean().item()
    assert r.top1 == pytest.approx(expected)
    assert r.confusion.sum() == m


def test_knn_classify__classes_missing_from_test_set():
    # 4 classes along the axes of R^4, 3 train points each (e_c + 0.1 e_{c+1 mod 4}, ...).
    # Test: e_0 (label 0), e_2 (label 2), e_1 labelled 0. With k = 3 each query's neighbours are
    # the 3 points of its own axis, so predictions are 0, 2, 1: top-1 = 2/3, class 0 = 1/2,
    # class 2 = 1/1; classes 1 and 3 never occur in the test set.
    eye = torch.eye(4)
    x_tr = torch.cat([eye + 0.1 * eye.roll(1, 1), eye + 0.1 * eye.roll(-1, 1), eye])
    y_tr = torch.arange(4).repeat(3)
    r = knn_classify(x_tr, y_tr, eye[[0, 2, 1]], torch.tensor([0, 2, 0]), k=3)
    assert r.predictions.tolist() == [0, 2, 1]
    assert r.top1 == pytest.approx(200 / 3)
    assert r.per_class_accuracy == {0: 50.0, 2: 100.0}
    expected = np.zeros((4, 4), dtype=np.int64)
    expected[0, 0] = expected[0, 1] = expected[2, 2] = 1
    np.testing.assert_array_equal(r.confusion, expected)
    assert r.classes == [0, 1, 2, 3]


def test_knn_classify__non_contiguous_labels_match_relabelled():
    x_tr, y_tr, x_te, y_te = _random_problem(4, c=3)
    values = torch.tensor([3, 7, 42])
    a = knn_classify(x_tr, y_tr, x_te, y_te, k=30)
    b = knn_classify(x_tr, values[y_tr], x_te, values[y_te], k=30)
    assert (a.top1, a.top5) == (b.top1, b.top5)
    assert 0 < a.top1 < 100  # a non-trivial problem
    assert b.classes == [3, 7, 42]
    assert torch.equal(b.predictions, values[a.predictions])
    np.testing.assert_array_equal(a.confusion, b.confusion)
    assert b.per_class_accuracy == {int(values[c]): v for c, v in a.per_class_accuracy.items()}
    assert (b.top5_k, b.top5) == (3, 100.0)  # fewer than 5 classes: top-5 = top-3


def test_knn_predict__empty_test_set_and_invalid_inputs():
    assert knn_predict(HAND_TRAIN, HAND_LABELS, torch.zeros(0, 2)).shape == (0, 3)
    with pytest.raises(ValueError, match="'k'"):
        knn_predict(HAND_TRAIN, HAND_LABELS, HAND_QUERY, k=0)
    with pytest.raises(ValueError, match="'T'"):
        knn_predict(HAND_TRAIN, HAND_LABELS, HAND_QUERY, T=0.0)
    with pytest.raises(ValueError, match="dimension"):
        knn_predict(HAND_TRAIN, HAND_LABELS, torch.ones(1, 3))
    with pytest.raises(ValueError, match="empty"):
        knn_predict(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), HAND_QUERY)
    with pytest.raises(ValueError, match=r"label 5 at row 2 .*0\.\.2 \(num_classes = 3\)"):
        knn_predict(HAND_TRAIN, torch.tensor([0, 1, 5, -1]), HAND_QUERY, num_classes=3)
    with pytest.raises(ValueError, match="NaN"):
        knn_predict(HAND_TRAIN, HAND_LABELS, torch.tensor([[float("nan"), 0.0]]))


# The instance of issue #16: bank b0 = (1, 0) label 0, b1 = (0, 1) label 3, b2 = (1, .1) label -1
# (unlabelled), query q = (1, .05). Cosines: s0 = 1 / sqrt(1.0025) = 0.998752,
# s1 = .05 / sqrt(1.0025) = 0.049938, s2 = 1.005 / (sqrt(1.0025) sqrt(1.01)) = 0.998772: the
# unlabelled row is the NEAREST one, so a kNN that let it vote would give it the largest share.
# Ignored, the vote is class 0 vs 3 only: share of 0 = 1 / (1 + e^((s1 - s0) / 0.1))
# = 1 / (1 + e^-9.48815) = 0.999924.
ISSUE_BANK = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1]])
ISSUE_LABELS = torch.tensor([0, 3, -1])
ISSUE_QUERY = torch.tensor([[1.0, 0.05]])


def test_knn_classify__unlabelled_bank_row_never_votes(caplog):
    with caplog.at_level("WARNING", logger="pipeline.evaluate.metrics"):
        r = knn_classify(ISSUE_BANK, ISSUE_LABELS, ISSUE_QUERY, torch.tensor([0]))
    assert r.predictions.tolist() == [0]
    assert r.classes == [0, 3] and r.top1 == 100.0 and r.k_used == 2
    assert "knn: train_labels: ignoring 1 of 3 rows labelled -1" in caplog.text


def test_knn_predict__unlabelled_bank_row_ignored_hand_computed():
    s = knn_predict(ISSUE_BANK, ISSUE_LABELS, ISSUE_QUERY, T=0.1)
    assert s.shape == (1, 4)  # classes 0..3: the largest label 3 + 1
    torch.testing.assert_close(
        s[0], torch.tensor([0.999924, 0.0, 0.0, 0.000076]), atol=1e-6, rtol=0
    )


def test_knn_classify__unlabelled_test_rows_not_scored(caplog):
    x_tr, y_tr, x_te, y_te = _random_problem(5, m=30)
    ref = knn_classify(x_tr, y_tr, x_te, y_te, k=20)
    y_te_partly = y_te.clone()
    y_te_partly[[0, 7, 29]] = -1  # 3 queries without a class
    keep = y_te_partly != -1
    with caplog.at_level("WARNING", logger="pipeline.evaluate.metrics"):
        got = knn_classify(x_tr, y_tr, x_te, y_te_partly, k=20)
    sub = knn_classify(x_tr, y_tr, x_te[keep], y_te[keep], k=20)
    assert (got.top1, got.top5, got.classes) == (sub.top1, sub.top5, sub.classes)
    assert torch.equal(got.predictions, sub.predictions) and len(got.predictions) == 27
    assert torch.equal(got.predictions, ref.predictions[keep])
    assert "knn: test_labels: ignoring 3 of 30 rows labelled -1" in caplog.text


def test_knn_classify__labels_out_of_range_are_named():
    with pytest.raises(ValueError, match=r"knn: train_labels: label 3 at row 1 is invalid"):
        knn_classify(ISSUE_BANK, ISSUE_LABELS, ISSUE_QUERY, torch.tensor([0]), num_classes=3)
    with pytest.raises(ValueError, match=r"knn: test_labels: label 7 at row 0 .*0\.\.3"):
        knn_classify(ISSUE_BANK, ISSUE_LABELS, ISSUE_QUERY, torch.tensor([7]), num_classes=4)
    with pytest.raises(ValueError, match=r"knn: train_labels: label -2 at row 2 .* >= 0"):
        knn_classify(ISSUE_BANK, torch.tensor([0, 3, -2]), ISSUE_QUERY, torch.tensor([0]))
    with pytest.raises(ValueError, match="no labelled row"):
        knn_classify(ISSUE_BANK, torch.full((3,), -1), ISSUE_QUERY, torch.tensor([0]))
    with pytest.raises(ValueError, match="empty test set"):
        knn_classify(ISSUE_BANK, ISSUE_LABELS, ISSUE_QUERY, torch.tensor([-1]))


# --- select_k_T: choosing k and T on a validation split ---------------------------------------

def test_select_k_T__hand_case__only_k3_soft_votes_are_right():
    # The hand-worked bank above, query (1, 0) labelled class 1. k=1 takes x0 (class 0): wrong.
    # k=3: class 0 gets e^(0.8/T), class 1 gets 2 e^(0.6/T); class 1 wins iff 2 > e^(0.2/T),
    # i.e. T > 0.2 / ln 2 = 0.2885. So T=0.1 is wrong and T=1.0 is right.
    from pipeline.evaluate.knn import select_k_T

    bank = torch.tensor([[0.8, 0.6], [0.6, 0.8], [0.6, -0.8], [-1.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 2])
    sel = select_k_T(bank, labels, torch.tensor([[1.0, 0.0]]), torch.tensor([1]),
                     ks=(1, 3), Ts=(0.1, 1.0))
    assert sel.grid == {(1, 0.1): 0.0, (1, 1.0): 0.0, (3, 0.1): 0.0, (3, 1.0): 100.0}
    assert (sel.k, sel.T, sel.val_top1) == (3, 1.0, 100.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_select_k_T__every_grid_point_equals_a_separate_knn_classify(seed):
    # One neighbour search serves the whole grid; each point must equal a full kNN run.
    from pipeline.evaluate.knn import select_k_T

    x_tr, y_tr, x_va, y_va = _random_problem(seed)
    ks, Ts = (1, 5, 20, 300, 500), (0.05, 0.5)  # 500 > N: dropped
    sel = select_k_T(x_tr, y_tr, x_va, y_va, ks=ks, Ts=Ts)
    assert set(sel.grid) == {(k, t) for k in (1, 5, 20, 300) for t in Ts}
    for (k, t), top1 in sel.grid.items():
        assert top1 == pytest.approx(knn_classify(x_tr, y_tr, x_va, y_va, k=k, T=t).top1)
    assert sel.val_top1 == max(sel.grid.values())
    first_best = next(kt for kt, v in sel.grid.items() if v == sel.val_top1)
    assert (sel.k, sel.T) == first_best  # ties go to the earlier grid point


def test_select_k_T__empty_grid_refused():
    from pipeline.evaluate.knn import select_k_T

    x_tr, y_tr, x_va, y_va = _random_problem(0)
    with pytest.raises(ValueError, match="grid is empty"):
        select_k_T(x_tr, y_tr, x_va, y_va, ks=())


def _classes(names: str) -> Manifest:
    """A test split's manifest as far as knn_eval reads it: its class names."""
    return Manifest(source="synthetic", split="test", num_samples=0, mode="L",
                    class_names=tuple(names), mean=(), std=(), shards=())


def test_knn_eval__val_top1_scores_the_linear_probe_split_against_the_rest(tmp_path, monkeypatch):
    # val_top1 = kNN of the held-out TRAIN rows (split_train_val, the linear probe's split)
    # against the remaining train rows; the test score still uses the whole train bank.
    from pipeline.config import KnnParams
    from pipeline.evaluate.features import FeatureSet, save_features
    from pipeline.evaluate.heldout import split_train_val
    from pipeline.evaluate.run import knn as run
    from pipeline.evaluate.run.knn import knn_eval

    x_tr, y_tr, x_te, y_te = _random_problem(3)
    for stem in ("", "_global"):
        save_features(FeatureSet(x_tr, y_tr, [f"tr{i}" for i in range(len(y_tr))]),
                      tmp_path / f"train{stem}.pt")
        save_features(FeatureSet(x_te, y_te, [f"te{i}" for i in range(len(y_te))]),
                      tmp_path / f"test{stem}.pt")
    monkeypatch.setattr(run, "read_manifest", lambda _: _classes("abcde"))
    out = knn_eval(features_dir=tmp_path, manifest_dir=tmp_path / "m",
                   knn=KnnParams(k=7, T=0.2, val_fraction=0.25, select="fixed"),
                   details_path=tmp_path / "d.json", seed=5)
    tr, va = split_train_val(len(y_tr), 0.25, 5)
    assert out["num_val"] == 75
    assert out["val_top1"] == pytest.approx(
        knn_classify(x_tr[tr], y_tr[tr], x_tr[va], y_tr[va], k=7, T=0.2).top1)
    assert out["top1"] == pytest.approx(knn_classify(x_tr, y_tr, x_te, y_te, k=7, T=0.2).top1)
    # the MoCo protocol on the global features: k=200, T=0.1 whatever knn.k / knn.T say
    assert out["protocol_top1"] == pytest.approx(
        knn_classify(x_tr, y_tr, x_te, y_te, k=200, T=0.1).top1)
    no_val = knn_eval(features_dir=tmp_path, manifest_dir=tmp_path / "m",
                      knn=KnnParams(k=7, T=0.2, select="fixed"), details_path=tmp_path / "d.json")
    assert "val_top1" not in no_val and no_val["top1"] == out["top1"]


def test_knn_eval__select_val_chooses_k_T_on_train_only(tmp_path, monkeypatch):
    # select = val: k and T come from the grid on KNN_SELECT_VAL_FRACTION of TRAIN (the pixel
    # baseline's split); reference = every grid point scored by plain knn_classify, best first
    # (ties to the earlier point); the test score uses the whole bank with the chosen values.
    from pipeline.config import KnnParams
    from pipeline.evaluate.features import FeatureSet, save_features
    from pipeline.evaluate.heldout import KNN_SELECT_VAL_FRACTION, split_train_val
    from pipeline.evaluate.knn import GRID_K, GRID_T
    from pipeline.evaluate.run import knn as run
    from pipeline.evaluate.run.knn import knn_eval

    x_tr, y_tr, x_te, y_te = _random_problem(4, n=400, m=60)
    tr, va = split_train_val(len(y_tr), KNN_SELECT_VAL_FRACTION, 2)
    grid = {(k, t): knn_classify(x_tr[tr], y_tr[tr], x_tr[va], y_tr[va], k=k, T=t).top1
            for k in GRID_K if k <= len(tr) for t in GRID_T}
    best = max(grid.values())
    k_ref, t_ref = next(kt for kt, v in grid.items() if v == best)
    monkeypatch.setattr(run, "read_manifest", lambda _: _classes("abcde"))

    def evaluate(test_labels):
        for stem in ("", "_global"):
            save_features(FeatureSet(x_tr, y_tr, [f"tr{i}" for i in range(len(y_tr))]),
                          tmp_path / f"train{stem}.pt")
            save_features(FeatureSet(x_te, test_labels, [f"te{i}" for i in range(len(y_te))]),
                          tmp_path / f"test{stem}.pt")
        return knn_eval(features_dir=tmp_path, manifest_dir=tmp_path / "m",
                        knn=KnnParams(k=7, T=0.3, select="val"),
                        details_path=tmp_path / "d.json", seed=2)

    out = evaluate(y_te)
    assert (out["k"], out["T"]) == (k_ref, t_ref) != (7, 0.3)
    assert out["select_val"] == 1 and out["select_val_top1"] == pytest.approx(best)
    assert out["top1"] == pytest.approx(
        knn_classify(x_tr, y_tr, x_te, y_te, k=k_ref, T=t_ref).top1)
    # the test labels never choose: scrambling them leaves k and T as they were
    scrambled = evaluate((y_te + 1) % 5)
    assert (scrambled["k"], scrambled["T"]) == (k_ref, t_ref)
    assert scrambled["top1"] != out["top1"]
    fixed = knn_eval(features_dir=tmp_path, manifest_dir=tmp_path / "m",
                     knn=KnnParams(k=7, T=0.3, select="fixed"), details_path=tmp_path / "d.json",
                     seed=2)
    assert (fixed["k"], fixed["T"]) == (7, 0.3) and "select_val" not in fixed
