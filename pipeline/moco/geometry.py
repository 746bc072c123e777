"""ResNet geometry without torch: the stem choice and the side of each stage's feature map.

:mod:`pipeline.moco.backbones` builds the networks; the params checks (``check_params``, which
must stay cheap) bound ``embed.pool_grid`` and the small crops with the same arithmetic, so it
lives here, where importing it costs no torch (and needs nothing above ``pipeline.config``).
``tests/evaluate/test_pooling.py`` checks every side against a real backbone's map.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.choices import Switch
from pipeline.errors import ParamsError

if TYPE_CHECKING:
    from pipeline.config import AugmentParams, Params

SMALL_STEM_BELOW_PX = 64  # model.small_stem auto: the 3x3 stem below this side (CIFAR, MNIST)


def uses_small_stem(setting: Switch | str | bool, side: int) -> bool:
    """``model.small_stem`` (``auto|true|false``) for ``side`` px images.

    ``auto`` is the small stem below :data:`SMALL_STEM_BELOW_PX`: the ImageNet stem's 7x7/2 conv
    plus max-pool would shrink 28-32 px images 4x before the first stage.

    Raises:
        InputError: not auto, true or false; names ``model.small_stem``.
    """
    return Switch.parse(setting, "model.small_stem").on(auto=side < SMALL_STEM_BELOW_PX)


def last_stage_side(side: int, small_stem: Switch | str | bool, stem_stride: int,
                    layer: int = 4) -> int:
    """Side of a ResNet's ``layer{layer}`` map for ``side`` px inputs (``embed.pool_grid``'s bound).

    Every stride-2 layer (3x3 pad 1, 7x7 pad 3, the max-pool, the 1x1 downsample) maps n to
    ceil(n / 2). The small stem (:func:`uses_small_stem`) divides by ``stem_stride``; the
    ImageNet stem by 4; then ``layer2..layer{layer}`` halve ``layer - 1`` times. 28 px with the
    stride-2 small stem: 4 after ``layer3``, 2 after ``layer4``.
    """
    def halve(n: int, by: int = 2) -> int:
        return (n + by - 1) // by

    n = halve(side, stem_stride) if uses_small_stem(small_stem, side) else halve(halve(side))
    for _ in range(layer - 1):
        n = halve(n)
    return n


def small_crop_side(augment: AugmentParams, side: int) -> int:
    """The small crops' side in px: ``augment.small_crop_size``, or half of ``side`` when 0."""
    return augment.small_crop_size or max(1, side // 2)


def check_pool_grid(p: Params, side: int, where: str = "") -> None:
    """Refuse an ``embed.pool_grid`` larger than the ``embed.layer`` map of ``side`` px images.

    Args:
        p: the params (``embed.pool_grid``, ``embed.layer``, ``model.small_stem``,
            ``model.stem_stride``).
        side: image side in px (:func:`pipeline.data.checks.image_side`, or a shard manifest's
            ``image_shape``).
        where: where ``side`` came from, for the message (e.g. a manifest path).

    Raises:
        ParamsError: the grid does not fit; the message names ``embed.pool_grid``, the map and
            the largest grid that fits.
    """
    if p.embed.pool_grid <= 1:
        return
    last = last_stage_side(side, p.model.small_stem, p.model.stem_stride, p.embed.layer)
    if p.embed.pool_grid > last:
        src = f" ({where})" if where else ""
        raise ParamsError.invalid(
            "embed.pool_grid", p.embed.pool_grid,
            f"<= {last}: {side} px images{src} leave a {last} x {last} map after "
            f"layer{p.embed.layer} (embed.layer; model.small_stem {p.model.small_stem}, "
            f"stem_stride {p.model.stem_stride})")
