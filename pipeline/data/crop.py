"""Per-image RandomResizedCrop for variable-size shards, seeded explicitly (loader workers).

Shards built with ``data.max_side`` hold whole images of different sizes, so they cannot be
stacked into one uint8 batch before cropping. The train loader then decodes each image and cuts
its views to ``image_size`` squares in the workers (:func:`pipeline.data.loader.train_loader`
with ``crop=``); every later op (jitter, grey, blur, flip, normalise) stays batched on the
training device.
"""

from __future__ import annotations

import math
import random

from PIL import Image

__all__ = ["RandomResizedCrop"]


class RandomResizedCrop:
    """torchvision's ``RandomResizedCrop`` drawing from a given :class:`random.Random`.

    The parameter search is torchvision's (``get_params``): up to 10 draws of an area fraction
    in ``scale`` and a log-uniform aspect ratio in ``ratio``, else a centre crop clamped to
    ``ratio``; the crop is resized to ``size x size`` with bilinear antialiased resampling.
    Random numbers come from the ``rng`` argument only, never a global RNG, so a crop is a pure
    function of the image and the seed (the loader seeds from ``(seed, epoch, position)``).

    Args:
        size: output side in pixels (``data.image_size``).
        scale: range of the crop's area as a fraction of the image (MoCo: 0.2-1).
        ratio: range of the crop's aspect ratio w/h (torchvision: 3/4-4/3).

    Raises:
        ValueError: ``size < 1`` or a malformed range.
    """

    def __init__(self, size: int, scale: tuple[float, float] = (0.2, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"scale must satisfy 0 < low <= high <= 1, got {scale}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < low <= high, got {ratio}")
        self.size, self.scale, self.ratio = size, tuple(scale), tuple(ratio)

    def params(self, width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
        """``(top, left, h, w)`` of one crop of a ``width x height`` image."""
        area = width * height
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(log_lo, log_hi))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                return rng.randint(0, height - h), rng.randint(0, width - w), h, w
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            h, w = height, round(height * self.ratio[1])
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, image: Image.Image, rng: random.Random) -> Image.Image:
        """One ``size x size`` crop of ``image`` (same mode)."""
        top, left, h, w = self.params(*image.size, rng)
        return image.resize((self.size, self.size), Image.BILINEAR,
                            box=(left, top, left + w, top + h), reducing_gap=None)
