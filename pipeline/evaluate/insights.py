"""What the embeddings say about the data, without labels: near-duplicate pairs and outliers.

Both come from one search, :func:`pipeline.evaluate.knn.self_neighbours`: the ``k`` most
cosine-similar other images of every image, in blocks (memory linear in N, never an (N, N)
matrix).

* **Near-duplicates**: the pairs ``{i, j}`` with ``j`` among the ``k`` nearest neighbours of
  ``i`` (or ``i`` among ``j``'s) and cosine >= ``duplicate_cosine``. An image with more than
  ``k`` near-copies reports its ``k`` closest; a group of ``m <= k + 1`` copies gives all its
  ``m (m - 1) / 2`` pairs.
* **Outliers**: the images whose mean cosine to their ``k`` nearest neighbours is lowest, i.e.
  farthest from everything else (the k-nearest-neighbour outlier score of Ramaswamy et al.,
  SIGMOD 2000, and Angiulli & Pizzuti, PKDD 2002, with cosine similarity for distance). Broken,
  blank or off-topic images tend to come first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.errors import InputError
from pipeline.evaluate.knn import DEFAULT_SELF_BLOCK_SIZE, self_neighbours


@dataclass(frozen=True)
class Neighbourhoods:
    """The result of the search, all on CPU.

    Attributes:
        pairs: (P, 2) int64 rows ``i < j`` of the near-duplicate pairs, most similar first
            (ties: smaller ``i``, then smaller ``j`` first).
        pair_cosine: (P,) float32 cosine of each pair.
        outlier_score: (N,) float32 mean cosine of each row to its ``k`` nearest other rows.
        k: the neighbours per row used.
        duplicate_cosine: the pair threshold used.
    """

    pairs: Tensor
    pair_cosine: Tensor
    outlier_score: Tensor
    k: int
    duplicate_cosine: float

    def outliers(self, count: int) -> Tensor:
        """The ``min(count, N)`` rows of lowest outlier score, lowest first (ties: lower row).

        Returns:
            (count,) int64 row indices.
        """
        order = torch.argsort(self.outlier_score, stable=True)  # ascending
        return order[: max(0, count)]

    def images_in_pairs(self) -> int:
        """How many distinct rows take part in at least one near-duplicate pair."""
        return int(torch.unique(self.pairs).numel())


def duplicate_pairs(sim: Tensor, idx: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """The pairs of a neighbour table with cosine >= ``threshold``, each pair once.

    Args:
        sim: (N, k) cosines of each row's neighbours (:func:`self_neighbours`).
        idx: (N, k) their row indices (never the row itself).
        threshold: the cosine a pair needs (``insights.duplicate_cosine``).

    Returns:
        ``(pairs, cosine)``: (P, 2) int64 rows ``i < j``, most similar first (ties: smaller
        ``i``, then ``j``), and (P,) float32 cosines. A pair found from both sides keeps the
        larger of its two computed cosines (they differ at most by rounding).
    """
    n = sim.shape[0]
    rows, cols = (sim >= threshold).nonzero(as_tuple=True)  # (E,), (E,): positions in the table
    a = rows.to(torch.long)
    b = idx[rows, cols]
    cos = sim[rows, cols]
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    code, inverse = torch.unique(lo * n + hi, return_inverse=True)  # (P,) sorted, each pair once
    best = torch.full((len(code),), float("-inf"), dtype=cos.dtype, device=cos.device)
    best = best.scatter_reduce(0, inverse, cos, reduce="amax")
    order = torch.argsort(-best, stable=True)  # most similar first; code order breaks ties
    code = code[order]
    pairs = torch.stack([code // n, code % n], dim=1)  # (P, 2)
    return pairs.cpu(), best[order].float().cpu()


def find_neighbourhoods(features: Tensor, *, duplicate_cosine: float, k: int,
                        block_size: int = DEFAULT_SELF_BLOCK_SIZE,
                        device: torch.device | str | None = None) -> Neighbourhoods:
    """Near-duplicate pairs and outlier scores of a set of embeddings (no labels needed).

    Args:
        features: (N, D) embeddings (any float dtype; compared by cosine), N >= 2.
        duplicate_cosine: a pair's cosine threshold, in (-1, 1] (``insights.duplicate_cosine``).
        k: neighbours per image (``insights.neighbours``), capped at N - 1.
        block_size: rows per side of a similarity block (memory: :func:`self_neighbours`).
        device: where to compute; default the device of ``features``.

    Returns:
        The :class:`Neighbourhoods`.

    Raises:
        ValueError: fewer than 2 rows, ``k < 1``, a threshold outside (-1, 1], or NaN / Inf in
            ``features``.
    """
    if features.ndim != 2 or features.shape[0] < 2:
        raise InputError(f"find_neighbourhoods: need (N, D) features with N >= 2, got "
                         f"{tuple(features.shape)}")
    if not -1 < duplicate_cosine <= 1:
        raise InputError(f"find_neighbourhoods: duplicate_cosine = {duplicate_cosine!r} is "
                         "invalid; allowed: -1 < x <= 1")
    if int(k) != k or k < 1:
        raise InputError(f"find_neighbourhoods: k = {k!r} is invalid; allowed: an integer >= 1")
    k_used = min(int(k), features.shape[0] - 1)
    sim, idx = self_neighbours(features, k=k_used, block_size=block_size, device=device)
    pairs, cosine = duplicate_pairs(sim, idx, duplicate_cosine)
    return Neighbourhoods(pairs=pairs, pair_cosine=cosine, outlier_score=sim.mean(dim=1).cpu(),
                          k=k_used, duplicate_cosine=float(duplicate_cosine))
