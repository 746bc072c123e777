"""The per-image torchvision MoCo recipes: the TEST REFERENCE for :mod:`pipeline.data.views`.

Training makes its views batched on the device with kornia (:mod:`pipeline.data.views`). This
module keeps the same presets written the way the official MoCo code writes them (PIL image in,
``(C, H, W)`` float tensor out), so tests can check the batched presets op by op against the
published tables, and ``benchmarks/data_throughput.py`` can time the per-image way.

* ``v1`` (He et al., CVPR 2020, Sec. 4.1): RandomResizedCrop(scale 0.2-1), RandomGrayscale(0.2),
  ColorJitter(0.4, 0.4, 0.4, 0.4) always, horizontal flip.
* ``v2`` (Chen et al., 2020, "aug+"): RandomResizedCrop(0.2-1), ColorJitter(0.4, 0.4, 0.4, 0.1)
  with p=0.8, RandomGrayscale(0.2), Gaussian blur σ ∈ [0.1, 2] with p=0.5, horizontal flip.
* ``v2_small``: ``v2`` without blur. ``v2_grey``: RandomResizedCrop, ColorJitter(brightness=0.4,
  contrast=0.4) with p=0.8, horizontal flip.

Every preset ends with ToTensor and Normalize(mean, std).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from PIL import Image, ImageFilter
from torchvision import transforms as T

from pipeline.config import AugPreset
from pipeline.seeds import derive_seed


class RandomGaussianBlur:
    """Gaussian blur of a PIL image with σ ~ U[sigma_min, sigma_max] (MoCo v2 / SimCLR).

    As the official MoCo v2 code, the blur is PIL's ``GaussianBlur(radius=σ)`` (σ in pixels,
    no kernel-size truncation, independent of the image size); unlike it, σ is drawn from the
    torch RNG so that seeding torch makes the transform reproducible.

    Args:
        sigma: ``(min, max)`` standard deviation in pixels, default (0.1, 2.0) as MoCo v2.

    Raises:
        ValueError: ``sigma`` not a pair with ``0 < min <= max``.
    """

    def __init__(self, sigma: Sequence[float] = (0.1, 2.0)) -> None:
        if len(sigma) != 2 or not 0 < sigma[0] <= sigma[1]:
            raise ValueError(
                f"RandomGaussianBlur: sigma must be (min, max) with 0 < min <= max, got {sigma}"
            )
        self.sigma = (float(sigma[0]), float(sigma[1]))

    def __call__(self, img: Image.Image) -> Image.Image:
        """Blur ``img`` with a freshly drawn σ."""
        s = float(torch.empty(1).uniform_(self.sigma[0], self.sigma[1]))
        return img.filter(ImageFilter.GaussianBlur(radius=s))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sigma={self.sigma})"


def build_pretrain_transform(
    preset: str,
    image_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    crop_min_scale: float = 0.2,
) -> T.Compose:
    """One random view of an image, for MoCo pretraining.

    Args:
        preset: ``v1``, ``v2``, ``v2_small`` or ``v2_grey`` (``augment.preset``).
        image_size: side of the square output crop, in pixels.
        mean: per-channel mean of the dataset (length = image channels), in [0, 1] units.
        std: per-channel standard deviation, same length.
        crop_min_scale: lower bound of RandomResizedCrop's area fraction
            (``augment.crop_min_scale``; 0.2 in MoCo v1/v2; the CIFAR-10 demo used
            torchvision's default 0.08).

    Returns:
        A transform PIL image → ``(C, image_size, image_size)`` float32 tensor.

    Raises:
        ValueError: unknown preset, ``image_size < 1``, ``crop_min_scale`` outside (0, 1], or
            ``mean``/``std`` of different lengths.
    """
    preset = AugPreset.parse(preset, "augment.preset")
    if not 0 < crop_min_scale <= 1:
        raise ValueError(f"augment.crop_min_scale must be in (0, 1], got {crop_min_scale}")
    crop = T.RandomResizedCrop(image_size, scale=(crop_min_scale, 1.0))
    tail = [T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(tuple(mean), tuple(std))]
    if preset == "v1":
        ops: list[Callable] = [
            crop,
            T.RandomGrayscale(p=0.2),
            T.ColorJitter(0.4, 0.4, 0.4, 0.4),
        ]
    elif preset in ("v2", "v2_small"):
        ops = [
            crop,
            T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
            T.RandomGrayscale(p=0.2),
        ]
        if preset == "v2":
            ops.append(T.RandomApply([RandomGaussianBlur((0.1, 2.0))], p=0.5))
    else:  # v2_grey
        ops = [crop, T.RandomApply([T.ColorJitter(brightness=0.4, contrast=0.4)], p=0.8)]
    return T.Compose(ops + tail)


def sample_seed(seed: int, epoch: int, key: str, draw: int = 0) -> int:
    """A per-sample seed (:func:`pipeline.seeds.derive_seed` of seed, epoch, draw and key)."""
    return derive_seed(int(seed), int(epoch), int(draw), key)


class TwoCropTransform:
    """Two independent random views (query, key) of one image, reproducible from a seed.

    The views are drawn under a forked torch CPU RNG seeded with ``seed`` (query first, then
    key), so the global torch RNG is left untouched and the same seed gives the same pair in
    any process. Python's ``random`` is not used by the presets and is not touched.

    Args:
        base: a transform from :func:`build_pretrain_transform`.
    """

    def __init__(self, base: Callable[[Image.Image], torch.Tensor]) -> None:
        self.base = base

    def __call__(self, img: Image.Image, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw the two views.

        Args:
            img: a PIL image (mode ``L`` → 1 channel, ``RGB`` → 3 channels).
            seed: e.g. ``sample_seed(params.seed, epoch, key)``.

        Returns:
            ``(q, k)``: two ``(C, H, W)`` float32 tensors.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            q = self.base(img)
            k = self.base(img)
        return q, k

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base!r})"
