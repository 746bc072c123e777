"""Feature pooling of a frozen backbone for evaluation (``embed.layer``, ``embed.pool_grid``).

Pretraining always pools the last stage globally (the MoCo head and the kNN monitor take
``(N, C)``); the embed stage, the random-encoder baseline and the augment-mode linear probe may
pool an earlier stage, and keep a coarse layout of its map.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.config import EMBED_LAYERS
from pipeline.errors import InputError


class GridPool(nn.Module):
    """Adaptive average pooling to a ``grid x grid`` map (the layout of ``embed.pool_grid``).

    ``grid = 1`` is global average pooling, the MoCo / InstDisc feature (a ResNet's own
    ``avgpool``). ``grid > 1`` keeps a coarse spatial layout: a 28 px Fashion-MNIST image leaves
    a 4 x 4 map after ``layer3`` with the stride-2 stem (2 x 2 after ``layer4``), and ``grid = 4``
    keeps all sixteen cells.
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
            raise InputError(f"embed.pool_grid must be >= 1, got {grid}")
        self.grid = grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) → (N, C, grid, grid), each cell the mean of its region."""
        h, w = x.shape[-2:]
        if h < self.grid or w < self.grid:
            raise InputError(
                f"embed.pool_grid = {self.grid} needs a map of at least {self.grid} x "
                f"{self.grid} at the pooled stage (embed.layer), but these images give "
                f"{h} x {w}: lower "
                f"embed.pool_grid (1 = global average pooling)")
        return nn.functional.adaptive_avg_pool2d(x, self.grid)


def set_pool_grid(backbone: nn.Module, grid: int, layer: int = 4) -> int:
    """Make a ResNet backbone's forward return ``layer{layer}``'s map pooled by ``grid``, in place.

    The stages after ``layer`` become ``nn.Identity`` (their weights leave the module), and
    ``avgpool`` becomes :class:`GridPool` ``(grid)`` (or global average pooling at 1). Every
    stage of a :class:`~pipeline.moco.backbones.WideResNet` doubles the channels of the one
    before, so ``layer{L}`` has ``C_4 / 2**(4 - L)`` channels, ``C_4`` the last stage's.

    Args:
        backbone: a :class:`WideResNet` (or any module with ``layer1..4``, ``avgpool`` and
            ``num_features`` whose forward runs them in order and flattens after ``avgpool``).
        grid: ``embed.pool_grid``; 1 keeps global average pooling.
        layer: ``embed.layer``, the stage whose map is pooled (4 = the last stage, as MoCo).

    Returns:
        The new feature width ``C_L * grid * grid`` (also stored in ``backbone.num_features``).
        E.g. width 32 (``C_4`` = 256), layer 3, grid 4: 128 x 16 = 2048.

    Raises:
        ValueError: ``grid < 1``, ``layer`` not in :data:`~pipeline.config.EMBED_LAYERS`, a
            ``layer`` later than one already cut off, or the backbone has no ``avgpool`` /
            ``num_features``.
    """
    if not hasattr(backbone, "avgpool") or not hasattr(backbone, "num_features"):
        raise InputError(f"{type(backbone).__name__} has no avgpool/num_features to re-pool")
    if layer not in EMBED_LAYERS:
        raise InputError(f"embed.layer must be one of {EMBED_LAYERS}, got {layer}")
    pooled = int(getattr(backbone, "pooled_layer", 4))
    if layer > pooled:
        raise InputError(f"embed.layer = {layer}: layer{pooled + 1}..4 were already removed "
                         "from this backbone; rebuild it")
    pool = GridPool(grid)
    last = int(getattr(backbone, "last_channels", backbone.num_features))
    for later in range(layer + 1, 5):
        setattr(backbone, f"layer{later}", nn.Identity())
    backbone.last_channels = last
    backbone.pooled_layer = layer
    backbone.avgpool = pool if grid > 1 else nn.AdaptiveAvgPool2d((1, 1))
    backbone.num_features = (last >> (4 - layer)) * grid * grid
    return backbone.num_features
