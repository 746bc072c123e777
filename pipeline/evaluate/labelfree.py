"""Quality without labels: RankMe, alignment, uniformity and view top-1 of an encoder.

For a user whose images nobody labelled, four numbers computed from images alone:

* **RankMe** (Garrido et al., ICML 2023): the effective rank of the ``(N, D)`` embedding matrix,
  ``exp(-sum_k p_k log p_k)`` with ``p_k = s_k / sum(s) + eps`` over its singular values ``s``.
  It reaches ``min(N, D)`` when every direction carries the same energy and falls toward 1 as
  the embeddings collapse onto fewer directions; Garrido et al. found it tracks downstream
  accuracy across SSL runs.
* **Alignment** (Wang & Isola, ICML 2020): the mean squared distance between the L2-normalised
  embeddings of two augmented views of one image, ``E ||f(x) - f(x')||^2`` (``alpha = 2``), in
  ``[0, 4]``; lower = views of one image land closer.
* **Uniformity** (Wang & Isola): ``log E exp(-t ||f(x) - f(y)||^2)`` over pairs of different
  images (``t = 2``), in ``[-4, 0]``; lower = the images spread more evenly over the sphere.
* **View top-1** (label-free view retrieval): two augmented views of each of N images; the
  share (%) of views whose nearest other view (cosine) is the same image's. Chance is
  ``100 / N`` (a constant encoder); higher = the encoder tells images apart across the
  augmentations, the task MoCo trains on, with views it never trained on.

All four are computed on the backbone's globally pooled features (what a user gets from
``models/encoder.pt``), in fp64 for the reductions, on a fixed sample of pretraining images:
the first ``n`` of the built ``pretrain`` split in manifest order (itself a seeded shuffle of
the source), resized and centre-cropped to the training side. The two views are the training
augmentation's (:func:`pipeline.data.views.build_batch_view`) under a fixed seed, so the same
encoder always gets the same numbers. :class:`pipeline.train.monitor.LabelFreeProbe` runs them
at every monitor point and at the end of pretraining, also without labels (``data.source:
none``). What each number answered on this project's data, and what the report shows it as:
:mod:`pipeline.report.labelfree_findings`; the run's verdict: :mod:`pipeline.evaluate.verdict`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipeline.errors import InputError
from pipeline.evaluate.normalize import l2_normalize

RANKME_EPS = 1e-7  # Garrido et al. 2023, the epsilon added to each normalised singular value
ALIGN_ALPHA = 2  # Wang & Isola 2020, the default exponent of the alignment loss
UNIFORM_T = 2.0  # Wang & Isola 2020, the default temperature of the uniformity loss
METRICS = ("rankme", "alignment", "uniformity", "view_top1")

def effective_rank(features: Tensor, eps: float = RANKME_EPS) -> float:
    """RankMe of an ``(N, D)`` embedding matrix (see the module docstring).

    Args:
        features: ``(N, D)`` embeddings, any float dtype (computed in fp64).
        eps: added to each normalised singular value (Garrido et al.: 1e-7).

    Returns:
        A number in ``[1, min(N, D)]`` (up to ``eps``).

    Raises:
        ValueError: ``features`` is not 2-D with at least one row, or holds a NaN/inf.
    """
    if features.ndim != 2 or features.shape[0] < 1:
        raise InputError(f"effective_rank: expected (N, D) features, got {tuple(features.shape)}")
    if not bool(torch.isfinite(features).all()):
        raise InputError("effective_rank: the features hold a NaN or an infinity")
    s = torch.linalg.svdvals(features.double())  # (min(N, D),)
    if float(s.sum()) == 0.0:
        return 1.0
    p = s / s.sum() + eps
    return float(torch.exp(-(p * torch.log(p)).sum()))


def _unit_views(what: str, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Two views' ``(N, D)`` embeddings, checked alike and L2-normalised in float64.

    Raises:
        ValueError: shapes differ or are not ``(N, D)`` with N >= 1 (names ``what``).
    """
    if a.shape != b.shape or a.ndim != 2 or a.shape[0] < 1:
        raise InputError(f"{what}: expected two (N, D) tensors of one shape, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    return l2_normalize(a.double()), l2_normalize(b.double())


def alignment(a: Tensor, b: Tensor, alpha: int = ALIGN_ALPHA) -> float:
    """``E ||a_i - b_i||^alpha`` over L2-normalised rows: views ``a`` and ``b`` of one image each.

    Args:
        a: ``(N, D)`` embeddings of the first views.
        b: ``(N, D)`` embeddings of the second views, row ``i`` of the same image as ``a[i]``.
        alpha: the exponent (Wang & Isola: 2).

    Returns:
        A number in ``[0, 2**alpha]``.

    Raises:
        ValueError: shapes differ or are not ``(N, D)`` with N >= 1.
    """
    za, zb = _unit_views("alignment", a, b)
    return float((za - zb).norm(dim=1).pow(alpha).mean())


def view_top1(a: Tensor, b: Tensor, chunk: int = 2048) -> float:
    """Label-free view retrieval: the share of images whose other view is their nearest.

    For each row of ``a`` the most cosine-similar row of ``b`` is looked up, and vice versa;
    a hit is the same image's view. Ties resolve to the lowest index, so an encoder with one
    output for every image finds only image 0: chance, ``100 / N``.

    Args:
        a: ``(N, D)`` embeddings of the first views.
        b: ``(N, D)`` embeddings of the second views, row ``i`` of the same image as ``a[i]``.
        chunk: rows per similarity block (memory: ``chunk x N`` floats).

    Returns:
        The mean of both directions' top-1, in percent, in ``[0, 100]``.

    Raises:
        ValueError: shapes differ or are not ``(N, D)`` with N >= 1.
    """
    za, zb = _unit_views("view_top1", a, b)
    hits = 0
    for x, y in ((za, zb), (zb, za)):
        for i in range(0, x.shape[0], chunk):
            nearest = (x[i:i + chunk] @ y.T).argmax(dim=1)  # first index among ties
            hits += int((nearest == torch.arange(i, i + nearest.shape[0])).sum())
    return 100.0 * hits / (2 * a.shape[0])


def uniformity(features: Tensor, t: float = UNIFORM_T) -> float:
    """``log E exp(-t ||z_i - z_j||^2)`` over the pairs ``i < j`` of L2-normalised rows.

    Args:
        features: ``(N, D)`` embeddings, N >= 2.
        t: the temperature (Wang & Isola: 2).

    Returns:
        A number in ``[-4 t, 0]`` (``-4 t`` only for antipodal pairs).

    Raises:
        ValueError: fewer than two rows.
    """
    if features.ndim != 2 or features.shape[0] < 2:
        raise InputError(f"uniformity: expected (N, D) features with N >= 2, got "
                         f"{tuple(features.shape)}")
    z = l2_normalize(features.double())
    sq = torch.pdist(z).pow(2)  # (N (N - 1) / 2,) squared distances of the pairs i < j
    return float(torch.logsumexp(-t * sq, dim=0) - math.log(sq.numel()))
