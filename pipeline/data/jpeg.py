"""JPEG members decoded with torchvision, and the per-image views cut from uint8 tensors.

With shards of whole images (``data.max_side``) the views of an image are cut per image before
batching (:class:`pipeline.data.views.SeededRandomResizedCrop` draws the boxes). Measured per
core on real photos (``benchmarks/photo_loader.py``, docs/performance.md),
``torchvision.io.decode_jpeg`` decodes a 500 x 375 JPEG in about half PIL's time, and
torchvision's antialiased bilinear resize of a uint8 tensor cuts a 224 px view in about half
the time of PIL's resize. So every view is cut here, from a ``(C, H, W)`` uint8 tensor
(:func:`cut_views`), and a JPEG is decoded by :func:`decode_jpeg_bytes` unless PIL's reduced
DCT decode (``draft``) applies, which torchvision lacks.

``pretrain.decode: device`` (:class:`pipeline.data.loader.EncodedBatch`): the workers read only
each JPEG's header and draw its boxes, and the training process decodes the whole batch on the
device at once with :func:`decode_jpeg_bytes` (nvjpeg on CUDA), then cuts the views there with
the same :func:`cut_views`. On a CPU device the same code runs on libjpeg-turbo, which is how it
is tested without a GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from pipeline.errors import InputError

JPEG_MAGIC = b"\xff\xd8\xff"  # SOI + the first marker's 0xFF: every JPEG starts so
Box = tuple[int, int, int, int]  # (top, left, height, width) in px of the full image
DRAFT_SCALES = (8, 4, 2)  # the reductions libjpeg's scaled IDCT offers below 1 (PIL draft)


def is_jpeg(data: bytes) -> bool:
    """Whether encoded bytes are a JPEG (by their first three bytes)."""
    return data[:3] == JPEG_MAGIC


def reduction(full_size: tuple[int, int], size: tuple[int, int]) -> int:
    """The JPEG DCT reduction ``k`` that turned an image of ``full_size`` into ``size``.

    libjpeg decodes ``W x H`` at 1/k as ``ceil(W / k) x ceil(H / k)``.

    Raises:
        ValueError: ``size`` is no such reduction of ``full_size``.
    """
    w, h = full_size
    for k in (1, *reversed(DRAFT_SCALES)):
        if size == (-(-w // k), -(-h // k)):
            return k
    raise InputError(f"image of {size[0]}x{size[1]} px is no DCT reduction of {w}x{h} px")


def decode_jpeg_bytes(data: torch.Tensor | Sequence[torch.Tensor], channels: int,
                      device: torch.device | str = "cpu") -> torch.Tensor | list[torch.Tensor]:
    """``torchvision.io.decode_jpeg`` in the split's channels, EXIF orientation not applied.

    Args:
        data: ``(n_bytes,)`` uint8 tensor(s) of JPEG files; a list decodes as one batch
            (nvjpeg's batched decode on CUDA).
        channels: 1 (grey: the JPEG's luma) or 3 (RGB; a grey JPEG's value copied thrice).
        device: where to decode.

    Returns:
        ``(C, H, W)`` uint8 tensor(s) on ``device``.

    Raises:
        RuntimeError: torchvision cannot decode the bytes.
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    with warnings.catch_warnings():  # torchvision 0.29 points to TorchCodec (docs/data.md)
        warnings.filterwarnings("ignore", category=DeprecationWarning,
                                message=".*decoding and encoding capabilities of TorchVision")
        return decode_jpeg(data if isinstance(data, torch.Tensor) else list(data), mode=mode,
                           device=device)


def cut_views(image: torch.Tensor, boxes: Sequence[Box], side: int, scale: int = 1
              ) -> torch.Tensor:
    """The views of one image: each box cropped and resized to ``side x side``.

    Resampling is torchvision's antialiased bilinear resize of the uint8 tensor (within 1 of
    PIL's bilinear filter, which ``SeededRandomResizedCrop.__call__`` uses).

    Args:
        image: ``(C, H, W)`` uint8: the full image, or a JPEG decoded at ``1/scale`` (PIL
            draft, ``ceil(W / scale) x ceil(H / scale)`` px).
        boxes: ``(top, left, height, width)`` per view, in pixels of the FULL image.
        side: output side in px.
        scale: the image's DCT reduction (1, 2, 4 or 8); box edges are divided by it and
            rounded to the reduced image's pixels.

    Returns:
        ``(V, C, side, side)`` uint8, on ``image``'s device.
    """
    from torchvision.transforms.v2 import functional as F

    out = []
    for top, left, h, w in boxes:
        if scale > 1:  # the box's edges in the reduced image
            t, lft = round(top / scale), round(left / scale)
            h, w = round((top + h) / scale) - t, round((left + w) / scale) - lft
            top, left = t, lft
        out.append(F.resized_crop(image, top, left, h, w, [side, side], antialias=True))
    return torch.stack(out)
