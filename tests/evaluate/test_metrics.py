import numpy as np
import pytest
import torch

from pipeline.evaluate.metrics import classification_metrics, contiguous_labels, labelled_mask

# 4 rows, 3 classes. Row 2 is unlabelled (-1) and its scores would rank class 2 first.
SCORES = torch.tensor(
    [
        [0.7, 0.2, 0.1],  # true 0, predicted 0
        [0.1, 0.3, 0.6],  # true 1, predicted 2 (class 1 second)
        [0.0, 0.1, 0.9],  # unlabelled
        [0.2, 0.5, 0.3],  # true 1, predicted 1
    ]
)
CLASSES = torch.tensor([0, 1, 2])


def test_classification_metrics__unlabelled_targets_ignored_by_hand(caplog):
    with caplog.at_level("WARNING", logger="pipeline.evaluate.metrics"):
        r = classification_metrics(SCORES, torch.tensor([0, 1, -1, 1]), CLASSES)
    # 3 labelled rows, 2 right: 66.67 %; top-3 of 3 classes: 100 %
    assert r.top1 == pytest.approx(200 / 3) and (r.top5_k, r.top5) == (3, 100.0)
    assert r.predictions.tolist() == [0, 2, 1]
    assert r.per_class_accuracy == {0: 100.0, 1: 50.0}
    np.testing.assert_array_equal(r.confusion, [[1, 0, 0], [0, 1, 1], [0, 0, 0]])
    assert "metrics: targets: ignoring 1 of 4 rows labelled -1" in caplog.text


def test_classification_metrics__targets_out_of_range_are_named():
    with pytest.raises(ValueError, match=r"metrics: targets: label 3 at row 1 .*0\.\.2"):
        classification_metrics(SCORES, torch.tensor([0, 3, -1, 1]), CLASSES)
    with pytest.raises(ValueError, match=r"label -4 at row 3"):
        classification_metrics(SCORES, torch.tensor([0, 1, 2, -4]), CLASSES)
    with pytest.raises(ValueError, match="empty test set"):
        classification_metrics(SCORES, torch.full((4,), -1), CLASSES)


def test_labelled_mask__rule():
    y = torch.tensor([2, -1, 0, -1])
    assert labelled_mask(y, what="x").tolist() == [True, False, True, False]
    assert labelled_mask(y, what="x", num_classes=3).tolist() == [True, False, True, False]
    with pytest.raises(ValueError, match=r"x: label 2 at row 0 is invalid; allowed: a class "
                                         r"index in 0\.\.1 \(num_classes = 2\), or -1"):
        labelled_mask(y, what="x", num_classes=2)
    with pytest.raises(ValueError, match="1-D integer"):
        labelled_mask(torch.tensor([0.0, 1.0]), what="x")


def test_contiguous_labels__refuses_negative_labels():
    classes, (a, b) = contiguous_labels(torch.tensor([42, 3]), torch.tensor([7, 3]))
    assert classes.tolist() == [3, 7, 42] and a.tolist() == [2, 0] and b.tolist() == [1, 0]
    with pytest.raises(ValueError, match="drop unlabelled rows"):
        contiguous_labels(torch.tensor([0, -1]))
