"""What the embeddings say about the data, without labels: near-duplicate pairs and outliers.

* **Near-duplicates**: from one search, :func:`pipeline.evaluate.knn.self_neighbours` on the
  encoder's features (the last stage, globally pooled): the ``k`` most cosine-similar other
  images of every image, in blocks (memory linear in N, never an (N, N) matrix). The pairs
  ``{i, j}`` with ``j`` among the ``k`` nearest neighbours of ``i`` (or ``i`` among ``j``'s)
  and cosine >= ``duplicate_cosine``. An image with more than ``k`` near-copies reports its
  ``k`` closest; a group of ``m <= k + 1`` copies gives all its ``m (m - 1) / 2`` pairs.
* **Outliers**: an image is odd when it is far from the others in at least one of
  :data:`VIEWS`, each turned into a robust z-score over the set (:func:`robust_z`: median 0,
  1 = one normal-consistent MAD); the outlier score is the largest of them, and the view that
  gives it is the image's *reason*:

  - ``embedding``: 1 - mean cosine to the ``k`` nearest others in the features above (the
    k-nearest-neighbour outlier score of Ramaswamy et al., SIGMOD 2000, with cosine), from the
    duplicates' search: an image unlike the others in content;
  - ``low_level``: the same score on the first stage's channel means and standard deviations
    (:func:`channel_statistics`, a second search): unusual tone, texture or colour. MoCo's
    augmentations (colour jitter, grey, blur, crops) teach the last stage to ignore exactly
    these, so junk (blank, noise, text, stripes, cut-off images) sits among the real images
    there and stands out here (results/outliers-2026-12-06.md);
  - ``near_constant``, ``noise_like``, ``flat_area``: pixel statistics
    (:func:`pixel_statistics`): a low pixel spread, a low correlation of neighbouring pixels,
    a large share of the image at one grey level.

  On its own the ``embedding`` view ranks junk in the middle of a weakly trained encoder's set
  (planted blank, noise and text images 244th-401st of 409 after a short run); the other views
  need no training to see them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeline.atomic import save_torch
from pipeline.errors import InputError
from pipeline.evaluate.knn import DEFAULT_SELF_BLOCK_SIZE, self_neighbours

VIEWS = ("embedding", "low_level", "near_constant", "noise_like", "flat_area")
PIXEL_STATISTICS = ("spread", "neighbour_correlation", "flat_share")
# near_constant = -log(spread + SPREAD_FLOOR): a constant image scores -log(1e-3) = 6.9 where
# real images score ~0 (spread ~1 in normalised units), far above every real image's z
SPREAD_FLOOR = 1e-3
# flat_share: pixels in the image's most common bin of this width, in normalised units (the
# eval transform divides by the set's pixel std: 0.05 std ~ 3 grey levels of 255 at std 0.25)
FLAT_BIN = 0.05
MAD_TO_SD = 1.4826  # MAD x this = the standard deviation of a normal distribution
MEAN_AD_TO_SD = 1.2533  # mean absolute deviation x this = the same (sqrt(pi / 2))


@dataclass(frozen=True)
class Neighbourhoods:
    """The result of the search, all on CPU.

    Attributes:
        pairs: (P, 2) int64 rows ``i < j`` of the near-duplicate pairs, most similar first
            (ties: smaller ``i``, then smaller ``j`` first).
        pair_cosine: (P,) float32 cosine of each pair.
        mean_cosine: (N,) float32 mean cosine of each row to its ``k`` nearest other rows (the
            ``embedding`` view before its z-score).
        views: (N, V) float32 robust z-score of every row in each of ``view_names``.
        view_names: the :data:`VIEWS` computed, in that order (``embedding`` always).
        k: the neighbours per row used.
        duplicate_cosine: the pair threshold used.
    """

    pairs: Tensor
    pair_cosine: Tensor
    mean_cosine: Tensor
    views: Tensor
    view_names: tuple[str, ...]
    k: int
    duplicate_cosine: float

    @property
    def outlier_score(self) -> Tensor:
        """(N,) float32: each row's largest view z-score (higher = odder)."""
        return self.views.max(dim=1).values

    def reasons(self, rows: Tensor) -> list[str]:
        """The view giving each row's outlier score (the first one on a tie)."""
        return [self.view_names[v] for v in self.views[rows].argmax(dim=1).tolist()]

    def outliers(self, count: int) -> Tensor:
        """The ``min(count, N)`` rows of highest outlier score, highest first (ties: lower row).

        Returns:
            (count,) int64 row indices.
        """
        order = torch.argsort(-self.outlier_score, stable=True)
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


def robust_z(values: Tensor) -> Tensor:
    """``(v - median) / scale`` of a set of values, robust to the outliers it is to find.

    The scale is the median absolute deviation x :data:`MAD_TO_SD`, or, where more than half
    the values equal the median (MAD 0), the mean absolute deviation x :data:`MEAN_AD_TO_SD`;
    a set of equal values gives all zeros.

    Args:
        values: (N,) float values, N >= 1.

    Returns:
        (N,) float32 z-scores.
    """
    v = values.double()
    med = v.median()  # the lower of the two middle values for an even N
    dev = (v - med).abs()
    scale = dev.median() * MAD_TO_SD
    if scale <= 0:
        scale = dev.mean() * MEAN_AD_TO_SD
    if scale <= 0:
        return torch.zeros_like(values, dtype=torch.float32)
    return ((v - med) / scale).float()


def channel_statistics(maps: Tensor) -> Tensor:
    """Each channel's mean and standard deviation over the spatial positions.

    Args:
        maps: (B, C, H, W) activations (any float dtype).

    Returns:
        (B, 2C) float32: the C means, then the C standard deviations (population).
    """
    m = maps.float().flatten(2)  # (B, C, H*W)
    return torch.cat([m.mean(dim=2), m.std(dim=2, correction=0)], dim=1)


def _correlation(a: Tensor, b: Tensor) -> Tensor:
    """Pearson correlation of the rows of two (B, M) tensors; 0 where a row is constant."""
    a = a - a.mean(dim=1, keepdim=True)
    b = b - b.mean(dim=1, keepdim=True)
    den = a.norm(dim=1) * b.norm(dim=1)
    return torch.where(den > 0, (a * b).sum(dim=1) / den.clamp(min=1e-30), 0.0)


def pixel_statistics(images: Tensor) -> Tensor:
    """Three statistics of each image's grey levels, in :data:`PIXEL_STATISTICS` order.

    Computed on the grey image (the mean over channels) of the evaluation transform's output
    (normalised units: pixel / 255 minus the set's mean, divided by its std):

    * ``spread``: the standard deviation of the pixels (0 for a constant image);
    * ``neighbour_correlation``: the correlation of each pixel with its right neighbour,
      averaged with that with its lower neighbour (the lag-1 autocorrelation: ~0.9 for
      photos and garments, ~0 for pixel noise); 1 for a constant image (no roughness);
    * ``flat_share``: the share of pixels in the image's most common bin of :data:`FLAT_BIN`
      (1 for a constant image; a blank border or a cut-off image's grey rest raise it).

    Args:
        images: (B, C, H, W) float images, H and W >= 2.

    Returns:
        (B, 3) float32.

    Raises:
        ValueError: not (B, C, H, W) or a side below 2 px.
    """
    if images.ndim != 4 or min(images.shape[-2:]) < 2:
        raise InputError(f"pixel_statistics: need (B, C, H, W) images with H, W >= 2, got "
                         f"{tuple(images.shape)}")
    g = images.float().mean(dim=1)  # (B, H, W)
    flat = g.flatten(1)
    spread = flat.std(dim=1, correction=0)
    across = _correlation(g[:, :, 1:].flatten(1), g[:, :, :-1].flatten(1))
    down = _correlation(g[:, 1:, :].flatten(1), g[:, :-1, :].flatten(1))
    corr = torch.where(spread > 0, (across + down) / 2, 1.0)
    bins = torch.floor(flat / FLAT_BIN)
    share = (bins == bins.mode(dim=1).values[:, None]).float().mean(dim=1)
    return torch.stack([spread, corr, share], dim=1)


def isolation_z(features: Tensor, *, k: int, block_size: int = DEFAULT_SELF_BLOCK_SIZE,
                device: torch.device | str | None = None) -> Tensor:
    """Robust z of 1 - the mean cosine of each row to its ``k`` nearest others (a search).

    Args:
        features: (N, D) rows, N > k.
        k: neighbours per row.
        block_size: rows per side of a similarity block (:func:`self_neighbours`).
        device: where to search; default the device of ``features``.

    Returns:
        (N,) float32 on CPU (higher = farther from its neighbours).
    """
    sim, _ = self_neighbours(features, k=k, block_size=block_size, device=device)
    return robust_z(1 - sim.double().mean(dim=1).cpu())


def pixel_views(stats: Tensor) -> Tensor:
    """The ``near_constant``, ``noise_like`` and ``flat_area`` z-scores of pixel statistics.

    Args:
        stats: (N, 3) :func:`pixel_statistics` of every image of the set.

    Returns:
        (N, 3) float32: robust z of ``-log(spread + SPREAD_FLOOR)``, of
        ``-neighbour_correlation`` and of ``flat_share``.
    """
    return torch.stack([robust_z(-torch.log(stats[:, 0].double() + SPREAD_FLOOR)),
                        robust_z(-stats[:, 1]), robust_z(stats[:, 2])], dim=1)


def _check(features: Tensor, duplicate_cosine: float, k: int,
           extra: dict[str, Tensor | None]) -> None:
    if features.ndim != 2 or features.shape[0] < 2:
        raise InputError(f"find_neighbourhoods: need (N, D) features with N >= 2, got "
                         f"{tuple(features.shape)}")
    if not -1 < duplicate_cosine <= 1:
        raise InputError(f"find_neighbourhoods: duplicate_cosine = {duplicate_cosine!r} is "
                         "invalid; allowed: -1 < x <= 1")
    if int(k) != k or k < 1:
        raise InputError(f"find_neighbourhoods: k = {k!r} is invalid; allowed: an integer >= 1")
    for name, t in extra.items():
        if t is not None and (t.ndim != 2 or t.shape[0] != features.shape[0]):
            raise InputError(f"find_neighbourhoods: {name} must be ({features.shape[0]}, *) "
                             f"like features, got {tuple(t.shape)}")


def find_neighbourhoods(features: Tensor, *, duplicate_cosine: float, k: int,
                        low_level: Tensor | None = None, pixels: Tensor | None = None,
                        block_size: int = DEFAULT_SELF_BLOCK_SIZE,
                        device: torch.device | str | None = None) -> Neighbourhoods:
    """Near-duplicate pairs and outlier views of a set of images (no labels needed).

    Args:
        features: (N, D) embeddings (any float dtype; compared by cosine), N >= 2.
        duplicate_cosine: a pair's cosine threshold, in (-1, 1] (``insights.duplicate_cosine``).
        k: neighbours per image (``insights.neighbours``), capped at N - 1.
        low_level: (N, 2C) :func:`channel_statistics` of the first stage, or None (no
            ``low_level`` view).
        pixels: (N, 3) :func:`pixel_statistics`, or None (no pixel views).
        block_size: rows per side of a similarity block (memory: :func:`self_neighbours`).
        device: where to compute; default the device of ``features``.

    Returns:
        The :class:`Neighbourhoods`.

    Raises:
        ValueError: fewer than 2 rows, ``k < 1``, a threshold outside (-1, 1], ``low_level``
            or ``pixels`` not one row per image, or NaN / Inf in ``features`` or
            ``low_level``.
    """
    _check(features, duplicate_cosine, k, {"low_level": low_level, "pixels": pixels})
    k_used = min(int(k), features.shape[0] - 1)
    sim, idx = self_neighbours(features, k=k_used, block_size=block_size, device=device)
    pairs, cosine = duplicate_pairs(sim, idx, duplicate_cosine)
    mean_cosine = sim.double().mean(dim=1).cpu()
    views, names = [robust_z(1 - mean_cosine)[:, None]], ["embedding"]
    if low_level is not None:
        views.append(isolation_z(low_level, k=k_used, block_size=block_size,
                                 device=device)[:, None])
        names.append("low_level")
    if pixels is not None:
        views.append(pixel_views(pixels.cpu()))
        names += ["near_constant", "noise_like", "flat_area"]
    return Neighbourhoods(pairs=pairs, pair_cosine=cosine, mean_cosine=mean_cosine.float(),
                          views=torch.cat(views, dim=1), view_names=tuple(names), k=k_used,
                          duplicate_cosine=float(duplicate_cosine))


NEIGHBOURHOODS_VERSION = 1


def save_neighbourhoods(path: Path, *, features: Tensor, keys: list[str], where: list[str],
                        outlier_score: Tensor, pairs: Tensor, built: int,
                        built_is_train: bool) -> None:
    """Write ``features/insights.pt`` atomically: the pretraining set as the search saw it.

    What the ``select_labels`` stage picks from (:mod:`pipeline.evaluate.run.select_labels`).

    Args:
        path: the file.
        features: (N, C) float32 global features of every pretraining image.
        keys: N sample keys.
        where: the shard file or URL of each.
        outlier_score: (N,) float32 outlier score (higher = odder).
        pairs: (P, 2) int64 near-duplicate row pairs.
        built: how many of the N rows (the first) are the built ``pretrain`` split.
        built_is_train: that split is the ``train`` split's shards (the same images, keys and
            labels: :func:`pipeline.evaluate.run.embed.same_shards`).
    """
    save_torch({"format_version": NEIGHBOURHOODS_VERSION, "features": features.contiguous(),
                "keys": list(keys), "where": list(where),
                "outlier_score": outlier_score.contiguous(), "pairs": pairs.contiguous(),
                "built": int(built), "built_is_train": bool(built_is_train)}, path)


def load_neighbourhoods(path: Path) -> dict[str, Any]:
    """Read :func:`save_neighbourhoods`' file (``torch.load(weights_only=True)``).

    Raises:
        FileNotFoundError: no such file.
        InputError: not a file of this format (the message names it: rerun data_insights).
    """
    if not path.is_file():
        raise FileNotFoundError(f"'{path}' does not exist: run the data_insights stage")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # zip/pickle errors come in several classes
        raise InputError(f"{path}: not readable: {e}") from None
    if not isinstance(data, dict) or data.get("format_version") != NEIGHBOURHOODS_VERSION:
        raise InputError(f"{path}: not a data_insights neighbourhood file of format "
                         f"{NEIGHBOURHOODS_VERSION}: rerun data_insights")
    n = len(data["keys"])
    if (data["features"].shape[0], len(data["where"]), len(data["outlier_score"])) != (n, n, n):
        raise InputError(f"{path}: its features, locations and scores disagree in length")
    return data
