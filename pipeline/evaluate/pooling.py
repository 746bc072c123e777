"""Feature pooling of a frozen backbone for evaluation (``embed.pool_grid``).

Pretraining always pools globally (the MoCo head and the kNN monitor take ``(N, C)``); the
embed stage and the augment-mode linear probe may keep a coarse layout of the last stage.
"""

from __future__ import annotations

import torch
from torch import nn


class GridPool(nn.Module):
    """Adaptive average pooling to a ``grid x grid`` map (the layout of ``embed.pool_grid``).

    ``grid = 1`` is global average pooling, the MoCo / InstDisc feature (a ResNet's own
    ``avgpool``). ``grid > 1`` keeps a coarse spatial layout: a 28 px Fashion-MNIST image leaves
    a 2 x 2 map after ``layer4`` with the stride-2 stem, and ``grid = 2`` keeps all four cells.
    The ResNet's forward flattens the result, channel-major: ``(N, C * grid * grid)``.

    Args:
        grid: cells per side (>= 1).

    Raises:
        ValueError: ``grid < 1`` (at construction), or an input map smaller than ``grid`` on a
            side (in ``forward``; adaptive pooling would repeat cells instead of pooling them).
    """

    def __init__(self, grid: int) -> None:
        super().__init__()
        if grid < 1:
            raise ValueError(f"embed.pool_grid must be >= 1, got {grid}")
        self.grid = grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) → (N, C, grid, grid), each cell the mean of its region."""
        h, w = x.shape[-2:]
        if h < self.grid or w < self.grid:
            raise ValueError(
                f"embed.pool_grid = {self.grid} needs a last-stage map of at least "
                f"{self.grid} x {self.grid}, but these images give {h} x {w}: lower "
                f"embed.pool_grid (1 = global average pooling)")
        return nn.functional.adaptive_avg_pool2d(x, self.grid)


def set_pool_grid(backbone: nn.Module, grid: int) -> int:
    """Replace a ResNet backbone's ``avgpool`` by :class:`GridPool` ``(grid)``, in place.

    Args:
        backbone: a :class:`WideResNet` (or any module with ``avgpool`` and ``num_features``
            whose forward flattens after ``avgpool``).
        grid: ``embed.pool_grid``; 1 keeps global average pooling.

    Returns:
        The new feature width ``C * grid * grid`` (also stored in ``backbone.num_features``),
        ``C`` = the last stage's channels.

    Raises:
        ValueError: ``grid < 1``, or the backbone has no ``avgpool`` / ``num_features``.
    """
    if not hasattr(backbone, "avgpool") or not hasattr(backbone, "num_features"):
        raise ValueError(f"{type(backbone).__name__} has no avgpool/num_features to re-pool")
    pool = GridPool(grid)
    channels = int(getattr(backbone, "pooled_channels", backbone.num_features))
    backbone.pooled_channels = channels
    backbone.avgpool = pool if grid > 1 else nn.AdaptiveAvgPool2d((1, 1))
    backbone.num_features = channels * grid * grid
    return backbone.num_features
