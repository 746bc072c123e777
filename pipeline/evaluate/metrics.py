"""Classification summary shared by the kNN classifier and the linear probe.

Top-1/top-5 accuracy (top-5 = top-min(5, C)), per-class accuracy and the confusion matrix
(sklearn.metrics.confusion_matrix), with a deterministic ranking on tied scores; plus the mapping
of arbitrary integer labels to contiguous class indices.

**Unlabelled rows, the one rule of every evaluation entry point** (:func:`knn_predict
<pipeline.evaluate.knn.knn_predict>`, :func:`knn_classify <pipeline.evaluate.knn.knn_classify>`,
:func:`train_linear_on_features <pipeline.evaluate.linear.train_linear_on_features>`,
:func:`train_linear_augment <pipeline.evaluate.linear.train_linear_augment>`,
:func:`classification_metrics` and the stages of :mod:`pipeline.evaluate.run`): label ``-1``
(:data:`UNLABELLED`, STL-10's unlabeled images, see :mod:`pipeline.data.sources`) marks a row
without a class. Such rows are IGNORED: dropped from banks, training sets and test sets before
anything is computed, and their count is logged (one warning per label set). Any other label
below 0, or at or above ``num_classes`` when the caller knows it, is REFUSED with a
``ValueError`` that names the offending value and its row (:func:`labelled_mask`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.errors import InputError

__all__ = [
    "UNLABELLED",
    "ClassificationMetrics",
    "classification_metrics",
    "contiguous_labels",
    "labelled_mask",
]

log = logging.getLogger(__name__)

UNLABELLED = -1  # the label of an image without a class (pipeline.data.sources)


def labelled_mask(labels: Tensor, *, what: str, num_classes: int | None = None) -> Tensor:
    """Which rows carry a class: the evaluation rule for unlabelled rows, in one place.

    Label ``-1`` (:data:`UNLABELLED`) = unlabelled: the row is to be ignored; their count is
    logged as a warning naming ``what``. Every other label must be a class index ``>= 0`` (and
    ``< num_classes`` when given).

    Args:
        labels: (N,) integer labels.
        what: names the labels in the log line and the error, e.g. ``"knn: train_labels"``.
        num_classes: C, when known: labels must then lie in ``0..C-1`` (or be -1).

    Returns:
        (N,) bool on ``labels.device``, True for the labelled rows.

    Raises:
        ValueError: ``labels`` is not a 1-D integer tensor, or a label is below -1 or (with
            ``num_classes``) at least ``num_classes``; the message names the first such value.
    """
    if labels.ndim != 1 or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise InputError(
            f"{what}: labels must be a 1-D integer tensor, got {tuple(labels.shape)} {labels.dtype}"
        )
    bad = labels < UNLABELLED
    if num_classes is not None:
        bad |= labels >= num_classes
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        allowed = "a class index >= 0" if num_classes is None else (
            f"a class index in 0..{num_classes - 1} (num_classes = {num_classes})")
        raise InputError(f"{what}: label {int(labels[row])} at row {row} is invalid; allowed: "
                         f"{allowed}, or -1 for an unlabelled row (ignored)")
    mask = labels != UNLABELLED
    ignored = len(labels) - int(mask.sum())
    if ignored:
        log.warning("%s: ignoring %d of %d rows labelled -1 (unlabelled)", what, ignored,
                    len(labels))
    return mask


@dataclass
class ClassificationMetrics:
    """Top-1/top-5 accuracy and per-class breakdown of one classifier on one test set.

    Attributes:
        top1: top-1 accuracy in percent (0-100).
        top5: top-``top5_k`` accuracy in percent, ``top5_k = min(5, C)``: with fewer than 5
            classes it is the top-C accuracy, i.e. 100.
        top5_k: the ``k`` actually used for ``top5``.
        per_class_accuracy: label value -> top-1 accuracy in percent, for every class that occurs
            in the test set (classes absent from the test set are omitted, not reported as 0).
        confusion: (C, C) int64 counts, rows = true class, columns = predicted class, both in the
            order of ``classes`` (sklearn.metrics.confusion_matrix).
        classes: (C,) the label values, sorted ascending; index ``c`` of a score row is
            ``classes[c]``.
        predictions: (M,) int64 predicted label values (original values, not indices).
    """

    top1: float
    top5: float
    top5_k: int
    per_class_accuracy: dict[int, float]
    confusion: np.ndarray
    classes: list[int]
    predictions: Tensor

    def metrics(self) -> dict[str, float]:
        """Numeric leaves for a metrics JSON: ``top1``, ``top5`` and ``class_<label>_top1``."""
        out = {"top1": self.top1, "top5": self.top5}
        out.update({f"class_{c}_top1": a for c, a in self.per_class_accuracy.items()})
        return out

    def details(self, class_names: list[str]) -> dict[str, Any]:
        """Per-class accuracy and confusion matrix in class-name order (``eval/*_details.json``).

        Args:
            class_names: the C names of the manifest; label ``i`` is ``class_names[i]``.

        Returns:
            ``class_names``; ``per_class_accuracy`` (C values, %, None for a class absent from
            the test set); ``confusion_matrix`` (C x C counts, rows = true class).
        """
        idx = {c: i for i, c in enumerate(self.classes)}
        n = len(class_names)
        conf = [[0] * n for _ in range(n)]
        for a, ra in idx.items():
            for b, rb in idx.items():
                if 0 <= a < n and 0 <= b < n:
                    conf[a][b] = int(self.confusion[ra][rb])
        return {"class_names": class_names,
                "per_class_accuracy": [self.per_class_accuracy.get(i) for i in range(n)],
                "confusion_matrix": conf}


def contiguous_labels(*label_sets: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Map arbitrary integer labels (e.g. {3, 7, 42}) to contiguous class indices {0, 1, 2}.

    The class index order is the ascending order of the label values, so "lowest class index"
    and "lowest label value" coincide.

    Args:
        *label_sets: (N_i,) integer label tensors (e.g. train and test labels); the class set is
            their union.

    Returns:
        ``classes`` (C,) int64 sorted label values (on CPU) and, per input, its (N_i,) int64 class
        indices (on the input's device).

    Raises:
        ValueError: a label tensor is not 1-D or not integer, or holds a negative label (drop
            unlabelled rows first, see :func:`labelled_mask`).
    """
    for y in label_sets:
        if y.ndim != 1 or y.dtype.is_floating_point or y.dtype == torch.bool:
            raise InputError(f"labels must be a 1-D integer tensor, got {tuple(y.shape)} {y.dtype}")
        if len(y) and int(y.min()) < 0:
            raise InputError(f"labels must be class indices >= 0, got {int(y.min())}; drop "
                             "unlabelled rows (-1) first (labelled_mask)")
    classes = torch.unique(torch.cat([y.detach().cpu().long() for y in label_sets]))  # sorted
    indices = [torch.searchsorted(classes.to(y.device), y.long()) for y in label_sets]
    return classes, indices


def classification_metrics(
    scores: Tensor, targets: Tensor, classes: Tensor
) -> ClassificationMetrics:
    """Summarise class scores against true class indices.

    Ranking is deterministic: classes are ordered by a stable descending sort of the scores, so on
    equal scores the lowest class index (= lowest label value) ranks first; the top-1 prediction
    is the first column of that ranking (the same as ``argmax``, which returns the first maximum).

    Rows whose target is -1 (unlabelled) are ignored, with a logged count; see the module
    docstring for the rule.

    Args:
        scores: (M, C) class scores, larger = more likely.
        targets: (M,) int64 true class indices in ``[0, C)``, or -1 for an unlabelled row.
        classes: (C,) label values of the score columns.

    Returns:
        The :class:`ClassificationMetrics` of the labelled rows (``predictions`` has one entry
        per labelled row, in order).

    Raises:
        ValueError: shapes do not match, a target is outside ``0..C-1`` and not -1 (the value is
            named), or no labelled row is left.
    """
    m_c = tuple(scores.shape)
    if scores.ndim != 2 or targets.shape != m_c[:1] or classes.shape != m_c[1:]:
        raise InputError(
            f"scores (M, C) = {tuple(scores.shape)}, targets (M,) = {tuple(targets.shape)} and "
            f"classes (C,) = {tuple(classes.shape)} do not match"
        )
    scores, targets = scores.detach().cpu(), targets.detach().cpu()
    keep = labelled_mask(targets, what="metrics: targets", num_classes=scores.shape[1])
    if not bool(keep.all()):
        scores, targets = scores[keep], targets[keep]
    m, c = scores.shape
    if m == 0:
        raise InputError("cannot compute accuracy on an empty test set (M = 0 labelled rows)")
    targets = targets.long()
    top5_k = min(5, c)
    ranking = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top5_k]  # M x 5
    pred = ranking[:, 0]
    top1 = 100.0 * (pred == targets).double().mean().item()
    top5 = 100.0 * (ranking == targets[:, None]).any(dim=1).double().mean().item()
    from sklearn.metrics import confusion_matrix  # here: scikit-learn takes ~1 s to import

    conf = confusion_matrix(targets.numpy(), pred.numpy(), labels=np.arange(c)).astype(np.int64)
    support = conf.sum(axis=1)
    per_class = {
        int(classes[i]): 100.0 * float(conf[i, i]) / float(support[i])
        for i in range(c)
        if support[i] > 0
    }
    return ClassificationMetrics(
        top1=top1,
        top5=top5,
        top5_k=top5_k,
        per_class_accuracy=per_class,
        confusion=conf,
        classes=[int(v) for v in classes],
        predictions=classes.cpu()[pred],
    )
