"""Which images to label: picking a labelling budget from the encoder's features, no labels.

Every method takes the L2-normalised global features ``x`` (N, D) of the pretraining images, a
budget ``b`` and an ``eligible`` mask (N,) and returns ``b`` row indices in pick order:

* ``random``: a seeded uniform draw without replacement (the baseline: what a user does
  without the encoder). It ignores ``eligible``: the baseline labels whatever comes.
* ``kcenter``: the greedy k-center coreset of Sener & Savarese (ICLR 2018): each pick is the
  eligible image farthest (cosine distance) from every image picked so far. The first is the
  eligible image closest to the mean feature (deterministic; the paper starts from the images
  already labelled, here none). Nested: the first ``b`` picks of a larger budget are the picks
  of budget ``b``.
* ``typical``: TypiClust (Hacohen et al., ICML 2022): k-means into ``b`` clusters, from each the
  most typical eligible image, typicality = 1 / mean Euclidean distance to its
  ``min(20, size - 1)`` nearest images of its cluster; picks in decreasing cluster size.
* ``probcover``: ProbCover (Yehuda et al., NeurIPS 2022): balls of radius ``delta`` (Euclidean,
  on the unit sphere) around every image; greedily the eligible image whose ball covers the most
  images not yet covered. ``delta`` is the paper's label-free choice: the largest radius at
  which a share ``purity`` of balls hold one k-means cluster only (:func:`probcover_delta`).
  Nested like ``kcenter``. Once every image is covered, the rest are random eligible images.

``eligible`` is where near-duplicates and outliers come in (:func:`eligible_mask`): an image
among the most isolated (the ``data_insights`` outlier score) is never picked by the three
encoder methods, and a near-duplicate of a picked image is never picked after it.

Memory stays linear in N: k-center keeps one (N,) distance vector; the typicality and the
ProbCover graph are computed in blocks of rows (the graph is kept as edge lists, int32).
Time: the typicality compares every pair of images within a cluster, exactly, up to
:data:`pipeline.evaluate.ann.EXACT_SEARCH_MAX_PAIRS` pairs per cluster (~100,000 images), on an
HNSW graph past it (:func:`pipeline.evaluate.knn.self_neighbours`); the ProbCover graph
compares every pair of the whole set (``selection.method: probcover`` only).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from pipeline.errors import InputError
from pipeline.evaluate.ann import approximate
from pipeline.evaluate.knn import self_neighbours

log = logging.getLogger(__name__)

METHODS = ("random", "kcenter", "typical", "probcover")
TYPICAL_NEIGHBOURS = 20  # TypiClust's k for the typicality (Hacohen et al. 2022, Sec. 3.2)
PROBCOVER_PURITY = 0.95  # ProbCover's alpha (Yehuda et al. 2022, Sec. 4.1)
PURITY_SAMPLE = 4096  # images whose nearest other-cluster image sets delta (seeded sample)
BLOCK = 2048  # rows per similarity block


def unit_rows(x: Tensor) -> Tensor:
    """``x`` (N, D) as fp32 rows of unit L2 norm (a zero row stays zero)."""
    x = x.float()
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def eligible_mask(n: int, *, outlier_score: Tensor | None, exclude_outliers: float) -> Tensor:
    """Images the encoder methods may pick: all but the most isolated ``exclude_outliers`` share.

    Args:
        n: images N.
        outlier_score: (N,) the ``data_insights`` outlier score (higher = odder), or None.
        exclude_outliers: share of images with the highest score left out, ``0 <= s < 1``
            (``selection.exclude_outliers``); ties at the cut are left out together.

    Returns:
        (N,) bool.
    """
    mask = torch.ones(n, dtype=torch.bool)
    cut = int(round(exclude_outliers * n))
    if outlier_score is not None and cut > 0:
        threshold = torch.sort(outlier_score.float(), descending=True).values[cut - 1]
        mask &= outlier_score.float() < threshold
    return mask


class _Duplicates:
    """The near-duplicate partners of every image, from the (P, 2) pairs of ``data_insights``."""

    def __init__(self, n: int, pairs: Tensor | None) -> None:
        self.partners: dict[int, list[int]] = {}
        if pairs is not None:
            for a, b in pairs.tolist():
                self.partners.setdefault(a, []).append(b)
                self.partners.setdefault(b, []).append(a)

    def block(self, row: int, mask: Tensor) -> None:
        """Make ``row`` and its partners ineligible in ``mask`` (in place)."""
        mask[row] = False
        for j in self.partners.get(row, ()):
            mask[j] = False


def pick_random(n: int, budget: int, *, seed: int, draw: int) -> list[int]:
    """``budget`` of ``n`` rows drawn uniformly without replacement, seeded by ``(seed, draw)``."""
    rng = np.random.default_rng([seed, 7919, draw])
    return rng.permutation(n)[:budget].tolist()


def pick_kcenter(x: Tensor, budget: int, *, eligible: Tensor,
                 pairs: Tensor | None = None) -> list[int]:
    """Greedy k-center picks (module docstring), ``budget`` rows in pick order.

    Args:
        x: (N, D) unit-norm rows (:func:`unit_rows`).
        budget: picks, ``<= eligible.sum()``.
        eligible: (N,) bool, rows that may be picked.
        pairs: (P, 2) near-duplicate row pairs; a picked row's partners are not picked.
    """
    ok = eligible.clone()
    dup = _Duplicates(len(x), pairs)
    mean = unit_rows(x.mean(dim=0, keepdim=True))[0]
    first = int(torch.where(ok, x @ mean, torch.tensor(-2.0)).argmax())
    picks = [first]
    dup.block(first, ok)
    nearest = 1 - x @ x[first]  # (N,) cosine distance to the nearest pick
    while len(picks) < budget:
        if not ok.any():
            break
        row = int(torch.where(ok, nearest, torch.tensor(-1.0)).argmax())
        picks.append(row)
        dup.block(row, ok)
        torch.minimum(nearest, 1 - x @ x[row], out=nearest)
    return picks


def _typicality(x: Tensor, k: int) -> Tensor:
    """(M,) 1 / mean Euclidean distance of each row of ``x`` (M, D) to its ``k`` nearest others."""
    m = len(x)
    k = min(k, m - 1)
    if k < 1:
        return torch.ones(m)
    if approximate(m, m, x.device):  # a cluster past 10^10 pairs: its HNSW graph
        sim, _ = self_neighbours(x, k=k)  # (M, k) cosines of the k nearest others
        return 1 / ((2 - 2 * sim).clamp_min(0).sqrt().mean(dim=1) + 1e-12)
    out = torch.empty(m)
    for r0 in range(0, m, BLOCK):
        sim = x[r0:r0 + BLOCK] @ x.T  # block x M
        sim[torch.arange(len(sim)), torch.arange(r0, r0 + len(sim))] = -2.0  # not itself
        top = sim.topk(k, dim=1).values
        dist = (2 - 2 * top).clamp_min(0).sqrt()  # unit rows: |a - b| = sqrt(2 - 2 cos)
        out[r0:r0 + BLOCK] = 1 / (dist.mean(dim=1) + 1e-12)
    return out


def kmeans(x: Tensor, clusters: int, *, seed: int) -> Tensor:
    """(N,) int64 cluster of each row: scikit-learn's k-means (k-means++, one init, seeded).

    Full-batch Lloyd up to 50 clusters, mini-batches (4096 rows) above, as TypiClust does.
    """
    from sklearn.cluster import KMeans, MiniBatchKMeans

    data = x.numpy()
    if clusters <= 50:
        km = KMeans(n_clusters=clusters, n_init=1, random_state=seed)
    else:
        km = MiniBatchKMeans(n_clusters=clusters, n_init=1, batch_size=4096, random_state=seed)
    return torch.from_numpy(km.fit_predict(data).astype(np.int64))


def pick_typical(x: Tensor, budget: int, *, eligible: Tensor, seed: int,
                 pairs: Tensor | None = None,
                 neighbours: int = TYPICAL_NEIGHBOURS) -> tuple[list[int], list[int]]:
    """TypiClust picks (module docstring): one per k-means cluster, the largest cluster first.

    Args:
        x: (N, D) unit-norm rows.
        budget: picks (= clusters), ``<= eligible.sum()``.
        eligible: (N,) bool.
        seed: k-means' seed.
        pairs: (P, 2) near-duplicate row pairs.
        neighbours: k of the typicality (default TypiClust's 20).

    Returns:
        ``(picks, clusters)``: the rows in pick order and the cluster of each. A cluster with no
        eligible row left gives none; the budget is then filled from the clusters' next most
        typical rows, largest cluster first.
    """
    ok = eligible.clone()
    dup = _Duplicates(len(x), pairs)
    labels = kmeans(x[eligible], budget, seed=seed)
    rows = torch.nonzero(eligible).flatten()
    sizes = torch.bincount(labels, minlength=budget)
    order = sorted(range(budget), key=lambda c: (-int(sizes[c]), c))
    ranked: dict[int, list[int]] = {}
    for c in order:
        members = rows[labels == c]
        if len(members):
            typ = _typicality(x[members], neighbours)
            ranked[c] = members[torch.argsort(-typ, stable=True)].tolist()
    picks: list[int] = []
    clusters: list[int] = []
    while len(picks) < budget:
        before = len(picks)
        for c in order:
            while ranked.get(c) and not ok[ranked[c][0]]:
                ranked[c].pop(0)
            if ranked.get(c) and len(picks) < budget:
                row = ranked[c].pop(0)
                picks.append(row)
                clusters.append(c)
                dup.block(row, ok)
        if len(picks) == before:
            break
    return picks, clusters


def probcover_delta(x: Tensor, *, clusters: int, seed: int, purity: float = PROBCOVER_PURITY,
                    sample: int = PURITY_SAMPLE) -> float:
    """ProbCover's ball radius: the largest at which a share ``purity`` of balls are pure.

    A ball of radius ``delta`` around image ``i`` is pure when every image in it has ``i``'s
    k-means cluster (``clusters`` of them, seeded): that holds exactly while ``delta`` is below
    the distance from ``i`` to its nearest image of another cluster. So the radius is the
    ``1 - purity`` quantile of that distance, here over a seeded sample of ``sample`` images.

    Returns:
        delta, a Euclidean distance between unit rows (0..2).
    """
    labels = kmeans(x, clusters, seed=seed)
    n = len(x)
    rng = np.random.default_rng([seed, 104729])
    rows = torch.from_numpy(np.sort(rng.choice(n, size=min(sample, n), replace=False)))
    nearest = torch.empty(len(rows))
    for r0 in range(0, len(rows), BLOCK):
        q = rows[r0:r0 + BLOCK]
        sim = x[q] @ x.T  # block x N
        sim[labels[q].unsqueeze(1) == labels.unsqueeze(0)] = -2.0  # same cluster: not counted
        nearest[r0:r0 + BLOCK] = (2 - 2 * sim.max(dim=1).values).clamp_min(0).sqrt()
    return float(torch.quantile(nearest, 1 - purity))


def ball_graph(x: Tensor, delta: float) -> tuple[Tensor, Tensor]:
    """Every image's ball: the rows within Euclidean ``delta`` of each row (itself included).

    Returns:
        ``(offsets, members)``: CSR, (N + 1,) int64 and (E,) int32; the ball of row ``i`` is
        ``members[offsets[i]:offsets[i + 1]]``, ascending.
    """
    cos = 1 - delta * delta / 2  # |a - b| <= delta  <=>  a.b >= 1 - delta^2 / 2 for unit rows
    counts, parts = [], []
    for r0 in range(0, len(x), BLOCK):
        hit = (x[r0:r0 + BLOCK] @ x.T) >= cos  # block x N
        hit[torch.arange(len(hit)), torch.arange(r0, r0 + len(hit))] = True
        counts.append(hit.sum(dim=1))
        parts.append(hit.nonzero()[:, 1].to(torch.int32))
    offsets = torch.zeros(len(x) + 1, dtype=torch.long)
    offsets[1:] = torch.cat(counts).cumsum(0)
    return offsets, torch.cat(parts)


def pick_probcover(x: Tensor, budget: int, *, eligible: Tensor, delta: float, seed: int,
                   pairs: Tensor | None = None) -> list[int]:
    """ProbCover picks (module docstring), ``budget`` rows in pick order.

    Args:
        x: (N, D) unit-norm rows.
        budget: picks, ``<= eligible.sum()``.
        eligible: (N,) bool.
        delta: the ball radius (:func:`probcover_delta`).
        seed: the random fill once every image is covered.
        pairs: (P, 2) near-duplicate row pairs.
    """
    ok = eligible.clone()
    dup = _Duplicates(len(x), pairs)
    offsets, members = ball_graph(x, delta)
    degree = (offsets[1:] - offsets[:-1]).clone()  # uncovered images in each ball
    covered = torch.zeros(len(x), dtype=torch.bool)
    rng = np.random.default_rng([seed, 15485863])
    picks: list[int] = []
    while len(picks) < budget and ok.any():
        gain = torch.where(ok, degree, torch.tensor(-1, dtype=degree.dtype))
        row = int(gain.argmax())
        if int(gain[row]) <= 0:  # all covered: random eligible rows
            rest = torch.nonzero(ok).flatten().numpy()
            row = int(rng.choice(rest))
        picks.append(row)
        dup.block(row, ok)
        ball = members[offsets[row]:offsets[row + 1]].long()
        new = ball[~covered[ball]]
        covered[new] = True
        # each newly covered image leaves the balls that hold it (balls are symmetric: the
        # balls holding v are the balls of v's members)
        starts, lens = offsets[new], offsets[new + 1] - offsets[new]
        if int(lens.sum()):
            first = torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens)
            held = members[first + torch.arange(int(lens.sum()))].long()
            degree.index_add_(0, held, torch.full_like(held, -1))
    return picks


def check_budgets(budgets: Sequence[int], n: int, *, what: str = "pretraining images",
                  where: str = "selection.budget") -> None:
    """Refuse budgets that cannot be picked from ``n`` images.

    Raises:
        InputError: a budget above ``n`` (naming ``where`` and ``what`` the ``n`` are).
    """
    too_big = [b for b in budgets if b > n]
    if too_big:
        raise InputError(f"{where}: budget {too_big[0]} is more than the {n} {what} (allowed: "
                         f"at most {n})")
