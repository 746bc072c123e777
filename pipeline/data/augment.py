"""MoCo augmentation presets, the evaluation transform and the two-crop transform.

Presets (PIL image in, ``(C, H, W)`` float tensor out), with the published parameters and order:

* ``v1`` (He et al., CVPR 2020, Sec. 4.1; official ``main_moco.py``): RandomResizedCrop(scale
  0.2–1), RandomGrayscale(p=0.2), ColorJitter(0.4, 0.4, 0.4, 0.4) always, horizontal flip.
* ``v2`` (Chen et al., 2020, "aug+"; official ``main_moco.py --aug-plus``): RandomResizedCrop
  (scale 0.2–1), ColorJitter(0.4, 0.4, 0.4, 0.1) with p=0.8, RandomGrayscale(p=0.2), Gaussian
  blur σ ∈ [0.1, 2] with p=0.5, horizontal flip.
* ``v2_small``: ``v2`` without blur, for images ≤ 64 px (the MoCo CIFAR-10 demo's recipe, which
  blurs nothing at 32 px).
* ``v2_grey``: for 1-channel images: RandomResizedCrop, ColorJitter(brightness=0.4,
  contrast=0.4) with p=0.8, horizontal flip (saturation, hue and grayscale do nothing to a
  grey image).

Every preset ends with ToTensor and Normalize(mean, std), the dataset statistics given by the
caller. All randomness comes from the torch CPU RNG (the transforms used draw nothing from
Python's ``random``), so :class:`TwoCropTransform` makes each pair a pure function of a seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from PIL import Image, ImageFilter
from torchvision import transforms as T

PRESETS = ("v1", "v2", "v2_small", "v2_grey")
EVAL_CROP_RATIO = 0.875  # resize 256 → center-crop 224, the ImageNet evaluation protocol


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
    if preset not in PRESETS:
        raise ValueError(f"augment.preset must be one of {', '.join(PRESETS)}; got {preset!r}")
    if not 0 < crop_min_scale <= 1:
        raise ValueError(f"augment.crop_min_scale must be in (0, 1], got {crop_min_scale}")
    _check_common(image_size, mean, std)
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


def build_eval_transform(image_size: int, mean: Sequence[float], std: Sequence[float]) -> T.Compose:
    """Deterministic transform for evaluation (kNN bank, features, linear probe).

    For ``image_size >= 128`` the ImageNet protocol: resize the shorter side to
    ``int(image_size / 0.875)`` (224 → 256) then center-crop ``image_size``. For small images
    resize the shorter side to ``image_size`` then center-crop (the identity for square images
    already of that size).

    Args:
        image_size: output side in pixels.
        mean: per-channel dataset mean.
        std: per-channel dataset standard deviation.

    Returns:
        A transform PIL image → ``(C, image_size, image_size)`` float32 tensor.

    Raises:
        ValueError: ``image_size < 1`` or ``mean``/``std`` of different lengths.
    """
    _check_common(image_size, mean, std)
    resize = int(image_size / EVAL_CROP_RATIO) if image_size >= 128 else image_size
    return T.Compose(
        [
            T.Resize(resize),
            T.CenterCrop(image_size),
            T.ToTensor(),
            T.Normalize(tuple(mean), tuple(std)),
        ]
    )


def _check_common(image_size: int, mean: Sequence[float], std: Sequence[float]) -> None:
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    if len(mean) != len(std) or len(mean) == 0:
        raise ValueError(f"mean and std must have one entry per channel, got {mean} and {std}")


def sample_seed(seed: int, epoch: int, key: str, draw: int = 0) -> int:
    """A seed for one sample's augmentation, stable across processes, machines and runs.

    BLAKE2b of ``"{seed}|{epoch}|{draw}|{key}"`` (never Python's salted ``hash()``), truncated
    to 63 bits.

    Args:
        seed: the run's seed (``seed`` in params).
        epoch: the epoch (or any counter that must change the views).
        key: the sample's unique key in the shards.
        draw: index of a further independent draw for the same sample and epoch.

    Returns:
        An int in ``[0, 2**63)``.
    """
    msg = f"{int(seed)}|{int(epoch)}|{int(draw)}|{key}".encode()
    digest = hashlib.blake2b(msg, digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


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
