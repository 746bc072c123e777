"""The held-out validation split of TRAIN: the one split every selection in evaluation uses.

Choices (the kNN's k and T, a recipe in a sweep) are made on rows of the TRAIN set held out
here, never on the test set. The kNN, the linear probe and the raw-pixel baselines cut the same
split from the same seed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.errors import InputError

# Share of TRAIN held out to choose a kNN's k and T: the tuned raw-pixel baseline always, the
# MoCo kNN with knn.select = val. Same seed, same split.
KNN_SELECT_VAL_FRACTION = 0.1
# At most this many of those held-out rows are scored: the choice's search is then at most
# 10,000 x N pairs, linear in N and exact (the cost of scoring a 10,000-image test set), where
# 10 % of N would be 0.09 N^2 pairs (96,000 x 864,000 at 960,000 train images: 20 min on 2
# cores on a graph, results/scale-2026-12-07-xeon.md). 10,000 rows give a top-1 within +-0.7 %
# (two standard errors at 87 %) for each (k, T) of the grid.
KNN_SELECT_MAX_VAL = 10_000


def split_train_val(n: int, val_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Split ``range(n)`` (rows of the TRAIN set) into train and validation indices.

    Args:
        n: number of training samples.
        val_fraction: share held out, ``0 <= val_fraction < 1``; the validation size is
            ``round(n * val_fraction)``, at least 1 when ``val_fraction > 0``.
        seed: seed of the permutation (same seed, same split).

    Returns:
        ``(train_idx, val_idx)``, int64, each sorted ascending, disjoint, together ``range(n)``.

    Raises:
        ValueError: ``val_fraction`` out of range, or a split that leaves a side empty.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise InputError(f"val_fraction = {val_fraction!r}; allowed: 0 <= x < 1")
    n_val = 0 if val_fraction == 0 else max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise InputError(f"val_fraction {val_fraction} of {n} samples leaves no train set")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[n_val:].sort().values, perm[:n_val].sort().values
