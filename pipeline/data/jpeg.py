"""JPEG members decoded with torchvision, and the per-image views cut from uint8 tensors.

With shards of whole images (``data.max_side``) the views of an image are cut per image before
batching (:class:`pipeline.data.views.SeededRandomResizedCrop` draws the boxes). Measured per
core on real photos (``benchmarks/photo_loader.py``, docs/performance.md),
``torchvision.io.decode_jpeg`` decodes a 500 x 375 JPEG in about half PIL's time, and
torchvision's antialiased bilinear resize of a uint8 tensor cuts a 224 px view in about half
the time of PIL's resize. So every view is cut here, from a ``(C, H, W)`` uint8 tensor
(:func:`cut_views`), and a JPEG is decoded by :func:`decode_jpeg_bytes` unless PIL's reduced
DCT decode (``draft``) applies, which torchvision lacks.

EXIF orientation: a JPEG member keeps its file's bytes and its tag, and every decode turns it
upright (:func:`upright`; PIL's decodes in :func:`pipeline.data.external.open_image`), so the
views' boxes are drawn in the upright image (:func:`pipeline.data.external.upright_size`).

``pretrain.decode: device`` (:class:`pipeline.data.loader.EncodedBatch`): the workers read only
each JPEG's header (its upright size and orientation) and draw its boxes, and the training
process decodes the whole batch on the device at once with :func:`decode_jpeg_bytes` (nvjpeg on
CUDA), then turns and cuts the views there with the same :func:`upright` and :func:`cut_views`.
On a CPU device the same code runs on libjpeg-turbo, which is how it is tested without a GPU.
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


# per EXIF orientation: the axes flipped, then whether H and W swap (tags 5-8); the same turns
# as PIL's ImageOps.exif_transpose (FLIP_LEFT_RIGHT, ROTATE_180, FLIP_TOP_BOTTOM, TRANSPOSE,
# ROTATE_270, TRANSVERSE, ROTATE_90 for 2..8)
_TURNS: dict[int, tuple[tuple[int, ...], bool]] = {
    1: ((), False), 2: ((-1,), False), 3: ((-2, -1), False), 4: ((-2,), False),
    5: ((), True), 6: ((-2,), True), 7: ((-2, -1), True), 8: ((-1,), True)}


def upright(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """A decoded image turned as its EXIF orientation says (what a viewer shows).

    Args:
        image: ``(C, H, W)``, as stored in the JPEG.
        orientation: its EXIF orientation, 1..8 (:func:`pipeline.data.external.orientation`
            of its header); 1 leaves it as it is.

    Returns:
        ``(C, H, W)``, or ``(C, W, H)`` for 5-8; on ``image``'s device.

    Raises:
        ValueError: ``orientation`` is not 1..8.
    """
    if orientation not in _TURNS:
        raise InputError(f"EXIF orientation must be 1..8, got {orientation!r}")
    flips, swap = _TURNS[orientation]
    if flips:
        image = image.flip(flips)
    return image.transpose(-2, -1).contiguous() if swap else image


def decode_jpeg_bytes(data: torch.Tensor | Sequence[torch.Tensor], channels: int,
                      device: torch.device | str = "cpu", *,
                      orientation: int | Sequence[int]) -> torch.Tensor | list[torch.Tensor]:
    """``torchvision.io.decode_jpeg`` in the split's channels, turned by the EXIF orientation.

    The orientation comes from the header PIL read (:func:`pipeline.data.external.orientation`)
    and is applied here (:func:`upright`) on every device: torchvision's own
    ``apply_exif_orientation`` is CPU-only (nvjpeg ignores it).

    Args:
        data: ``(n_bytes,)`` uint8 tensor(s) of JPEG files; a list decodes as one batch
            (nvjpeg's batched decode on CUDA).
        channels: 1 (grey: the JPEG's luma) or 3 (RGB; a grey JPEG's value copied thrice).
        device: where to decode.
        orientation: each JPEG's EXIF orientation (1..8): an int for one tensor, one per tensor
            for a list.

    Returns:
        ``(C, H, W)`` uint8 tensor(s) on ``device``, upright (``H x W`` as displayed).

    Raises:
        RuntimeError: torchvision cannot decode the bytes.
        ValueError: an orientation outside 1..8, or not one per JPEG.
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    one = isinstance(data, torch.Tensor)
    turns = [orientation] if isinstance(orientation, int) else list(orientation)
    if len(turns) != (1 if one else len(data)):
        raise InputError(f"{len(turns)} orientation(s) for {1 if one else len(data)} JPEG(s)")
    with warnings.catch_warnings():  # torchvision 0.29 points to TorchCodec (docs/data.md)
        warnings.filterwarnings("ignore", category=DeprecationWarning,
                                message=".*decoding and encoding capabilities of TorchVision")
        images = decode_jpeg([data] if one else list(data), mode=mode, device=device)
    images = [upright(im, o) for im, o in zip(images, turns, strict=True)]
    return images[0] if one else images


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
