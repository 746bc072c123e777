"""MoCo's two views, made per batch on the training device with kornia.

The loaders yield uint8 batches ``(B, C, H, W)``; :class:`BatchTwoCrop` turns one into the query
and key views on whatever device the batch is on (CPU or CUDA). Each preset keeps the published
parameters and order of :mod:`pipeline.data.augment` (the per-image torchvision reference),
with random parameters drawn per sample:

* ``v1``: RandomResizedCrop(scale ``crop_min_scale``–1, ratio 3/4–4/3), RandomGrayscale(0.2),
  ColorJitter(0.4, 0.4, 0.4, 0.4) always, horizontal flip.
* ``v2``: RandomResizedCrop, ColorJitter(0.4, 0.4, 0.4, 0.1) with p=0.8, RandomGrayscale(0.2),
  Gaussian blur σ ∈ [0.1, 2] px with p=0.5, horizontal flip.
* ``v2_small``: ``v2`` without blur.
* ``v2_grey``: RandomResizedCrop, ColorJitter(brightness 0.4, contrast 0.4) with p=0.8,
  horizontal flip.

Every preset ends with Normalize(mean, std). Where each op runs: the shards hold fixed-size
images (the manifest's ``image_shape``), so decoding runs in the loader workers and every op
above runs batched on the training device. Two documented differences from torchvision:
kornia draws the order of ColorJitter's four ops once per batch (torchvision: per image; for
``v2_grey``'s brightness and contrast the order does not matter up to clamping), and the blur is
a 13-tap Gaussian kernel (covers ±3σ at σ = 2) where the official code uses PIL's radius-σ blur.

Reproducibility: the views are a pure function of the batch and
:func:`batch_seed` ``(seed, epoch, step, rank)``: kornia draws its parameters from the torch
RNG, which is forked and seeded around each call, so the global RNG is untouched and a resumed
run makes the same views as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import kornia.augmentation as K
import torch
from torch import nn

from pipeline.data.augment import PRESETS

BLUR_KERNEL = 13  # 2 * ceil(3 * sigma_max) + 1 for sigma_max = 2 px (MoCo v2)


def batch_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """The augmentation seed of one batch, stable across processes, machines and runs.

    BLAKE2b of ``"{seed}|{epoch}|{step}|{rank}"``, truncated to 63 bits (never Python's salted
    ``hash()``).

    Args:
        seed: the run's seed.
        epoch: 0-based epoch.
        step: global optimizer step (0-based).
        rank: process rank.

    Returns:
        An int in ``[0, 2**63)``.
    """
    msg = f"{int(seed)}|{int(epoch)}|{int(step)}|{int(rank)}".encode()
    return int.from_bytes(hashlib.blake2b(msg, digest_size=8).digest(), "little") >> 1


def build_batch_view(preset: str, image_size: int, mean: Sequence[float], std: Sequence[float],
                     crop_min_scale: float = 0.2, crop: bool = True) -> nn.Sequential:
    """One random view of a float batch in [0, 1], per-sample parameters.

    Args:
        preset: ``v1``, ``v2``, ``v2_small`` or ``v2_grey`` (``augment.preset``).
        image_size: side of the square output crop, in pixels.
        mean: per-channel dataset mean, in [0, 1] units.
        std: per-channel dataset standard deviation.
        crop_min_scale: RandomResizedCrop's lower area bound (0.2 in MoCo v1/v2).
        crop: False for batches already cropped per image in the loader workers
            (variable-size shards, ``train_loader(crop=...)``): every op but the crop.

    Returns:
        A module ``(B, C, H, W)`` float in [0, 1] → ``(B, C, image_size, image_size)`` normalised.

    Raises:
        ValueError: unknown preset, ``crop_min_scale`` outside (0, 1], ``image_size < 1``, or
            ``mean``/``std`` of different or zero length.
    """
    if preset not in PRESETS:
        raise ValueError(f"augment.preset must be one of {', '.join(PRESETS)}; got {preset!r}")
    if not 0 < crop_min_scale <= 1:
        raise ValueError(f"augment.crop_min_scale must be in (0, 1], got {crop_min_scale}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    if len(mean) != len(std) or not mean:
        raise ValueError(f"mean and std must have one entry per channel, got {mean} and {std}")
    rrc = K.RandomResizedCrop((image_size, image_size), scale=(crop_min_scale, 1.0),
                              ratio=(3 / 4, 4 / 3), cropping_mode="resample")
    if preset == "v1":
        ops: list[nn.Module] = [rrc, K.RandomGrayscale(p=0.2),
                                K.ColorJitter(0.4, 0.4, 0.4, 0.4, p=1.0)]
    elif preset in ("v2", "v2_small"):
        ops = [rrc, K.ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.8), K.RandomGrayscale(p=0.2)]
        if preset == "v2":
            ops.append(K.RandomGaussianBlur((BLUR_KERNEL, BLUR_KERNEL), (0.1, 2.0), p=0.5))
    else:  # v2_grey
        ops = [rrc, K.ColorJitter(brightness=0.4, contrast=0.4, p=0.8)]
    if not crop:
        ops = ops[1:]
    ops += [K.RandomHorizontalFlip(p=0.5),
            K.Normalize(mean=torch.tensor(list(mean)), std=torch.tensor(list(std)))]
    return nn.Sequential(*ops)


class BatchTwoCrop:
    """Query and key views of a uint8 batch, on the batch's device, reproducible from a seed.

    Args:
        view: a module from :func:`build_batch_view`.
        memory_format: layout of the returned views (``torch.channels_last`` when the model
            runs channels_last).
    """

    def __init__(self, view: nn.Module,
                 memory_format: torch.memory_format = torch.contiguous_format) -> None:
        self.view, self.memory_format = view, memory_format

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw both views.

        Args:
            images: ``(B, C, H, W)`` uint8 on the training device, or ``(B, 2, C, S, S)``:
                the two views already cropped per image (then ``view`` has no crop).
            seed: e.g. :func:`batch_seed` ``(seed, epoch, step, rank)``.

        Returns:
            ``(im_q, im_k)``: two ``(B, C, S, S)`` float32 tensors on the same device.

        Raises:
            ValueError: ``images`` is not a 4-d uint8 tensor.
        """
        two = images.dim() == 5 and images.shape[1] == 2
        if images.dtype != torch.uint8 or not (images.dim() == 4 or two):
            raise ValueError(f"expected a (B, C, H, W) or (B, 2, C, S, S) uint8 batch, got "
                             f"{images.dtype} {tuple(images.shape)}")
        x = images.float().div_(255)
        xq, xk = (x[:, 0], x[:, 1]) if two else (x, x)
        devices = [images.device] if images.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=images.device.type):
            torch.manual_seed(seed)
            q = self.view(xq)
            k = self.view(xk)
        return (q.contiguous(memory_format=self.memory_format),
                k.contiguous(memory_format=self.memory_format))
