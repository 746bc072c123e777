"""Classification summary shared by the kNN classifier and the linear probe.

Top-1/top-5 accuracy (top-5 = top-min(5, C)), per-class accuracy and the confusion matrix
(sklearn.metrics.confusion_matrix), with a deterministic ranking on tied scores; plus the mapping
of arbitrary integer labels to contiguous class indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from sklearn.metrics import confusion_matrix
from torch import Tensor

__all__ = ["ClassificationMetrics", "classification_metrics", "contiguous_labels"]


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
        ValueError: a label tensor is not 1-D or not integer.
    """
    for y in label_sets:
        if y.ndim != 1 or y.dtype.is_floating_point or y.dtype == torch.bool:
            raise ValueError(f"labels must be a 1-D integer tensor, got {tuple(y.shape)} {y.dtype}")
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

    Args:
        scores: (M, C) class scores, larger = more likely.
        targets: (M,) int64 true class indices in ``[0, C)``.
        classes: (C,) label values of the score columns.

    Returns:
        The :class:`ClassificationMetrics`.

    Raises:
        ValueError: shapes do not match, or the test set is empty.
    """
    m_c = tuple(scores.shape)
    if scores.ndim != 2 or targets.shape != m_c[:1] or classes.shape != m_c[1:]:
        raise ValueError(
            f"scores (M, C) = {tuple(scores.shape)}, targets (M,) = {tuple(targets.shape)} and "
            f"classes (C,) = {tuple(classes.shape)} do not match"
        )
    m, c = scores.shape
    if m == 0:
        raise ValueError("cannot compute accuracy on an empty test set (M = 0)")
    scores, targets = scores.detach().cpu(), targets.detach().cpu().long()
    top5_k = min(5, c)
    ranking = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top5_k]  # M x 5
    pred = ranking[:, 0]
    top1 = 100.0 * (pred == targets).double().mean().item()
    top5 = 100.0 * (ranking == targets[:, None]).any(dim=1).double().mean().item()
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
