"""How build_shards stores each image: PNG or JPEG bytes, byte-reproducible, and the resize.

``data.shard_format`` (:func:`encode_member`):

* ``auto`` (default): a JPEG file (ImageFolder, unlabelled tree, webdataset source) whose pixels
  need no change (no mode conversion but grey to RGB, no resize) keeps its bytes as
  ``<key>.jpg``, an EXIF orientation tag included: every reader turns the image upright when
  decoding (:func:`pipeline.data.external.open_image`, :func:`pipeline.data.jpeg.upright`); a
  JPEG that was converted or resized (after its turn) is encoded as JPEG at quality
  :data:`JPEG_QUALITY`; every other image (PNG, TIFF, WebP, BMP files, Fashion-MNIST,
  CIFAR and STL-10 arrays) as lossless PNG. A photo's shards are then about the size of its
  JPEGs instead of ~5x (docs/performance.md, ``benchmarks/photo_loader.py``).
* ``png``: every image as PNG: the stored pixels are exactly what the conversion and resize
  produced.
* ``jpeg``: every image as JPEG (kept bytes where ``auto`` keeps them, else quality 95).

A split that holds a JPEG member records the choice in its manifest (``build.shard_format``,
``build.jpeg_quality`` and ``build.members``, the count per kind); a split of PNGs only
records nothing new, so its manifest is byte for byte what it was before JPEG members existed.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import Any

from PIL import Image

from pipeline.config import ShardFormat
from pipeline.data.sources import Sample
from pipeline.errors import InputError

_PNG_OPTIONS = {"format": "PNG", "compress_level": 6, "optimize": False}  # Pillow's default level
# Quality of the JPEGs build_shards encodes (resized or converted photos): 95, kept by
# measurement: 200 q90 500x375 photos resized to a 256 px short side take 0.66x their source
# bytes at q95 4:2:0 and keep 39.3 dB PSNR of the resized pixels (q90: 0.47x, 36.6 dB; q95
# 4:4:4: 0.84x, 42.8 dB); with tar headers the shards are 0.70x (benchmarks/photo_loader.py,
# docs/data.md "Shard formats").
JPEG_QUALITY = 95
# 4:2:0 chroma (libjpeg's default, as most cameras write): a re-encoded photo has no finer
# chroma to keep; baseline, not optimised or progressive (fastest to decode, fixed bytes)
_JPEG_OPTIONS = {"format": "JPEG", "quality": JPEG_QUALITY, "subsampling": 2, "optimize": False,
                 "progressive": False}
MEMBER_KINDS = ("jpg_copied", "jpg_encoded", "png")  # build.members: how each image was stored


def _encode(image: Image.Image, options: dict[str, Any]) -> bytes:
    # ICC profiles, EXIF etc. in ``info`` would be copied into the file: saved without them,
    # and put back after (a copy of the image without them would double a 60 MP photo's memory)
    info, image.info = image.info, {}
    try:
        buf = io.BytesIO()
        image.save(buf, **options)
    finally:
        image.info = info
    return buf.getvalue()


def encode_png(image: Image.Image) -> bytes:
    """Encode an image as PNG with fixed options and no metadata (byte-reproducible).

    Args:
        image: PIL image in mode ``L`` or ``RGB``.

    Returns:
        The PNG bytes.
    """
    return _encode(image, _PNG_OPTIONS)


def encode_jpeg(image: Image.Image) -> bytes:
    """Encode an image as baseline JPEG, quality :data:`JPEG_QUALITY`, 4:2:0, no metadata.

    Byte-reproducible with one libjpeg (the one Pillow ships).

    Args:
        image: PIL image in mode ``L`` or ``RGB``.

    Returns:
        The JPEG bytes.
    """
    return _encode(image, _JPEG_OPTIONS)


def encode_member(sample: Sample, shard_format: str) -> tuple[str, bytes, str]:
    """How one sample's image is stored (the module docstring has the rules).

    Args:
        sample: the sample as written (its :attr:`~pipeline.data.sources.base.Sample.file`
            says where the image came from and whether its bytes still describe it).
        shard_format: ``auto``, ``png`` or ``jpeg`` (``data.shard_format``).

    Returns:
        ``(extension, bytes, kind)``: ``("jpg", file bytes, "jpg_copied")``,
        ``("jpg", encoded, "jpg_encoded")`` or ``("png", encoded, "png")``.

    Raises:
        ValueError: an unknown ``shard_format``.
    """
    if shard_format not in ShardFormat.names():
        raise InputError(f"data.shard_format must be one of {', '.join(ShardFormat.names())}; "
                         f"got {shard_format!r}")
    file = sample.file
    jpeg_file = file is not None and file.format == "JPEG"
    if shard_format == ShardFormat.png or (shard_format == ShardFormat.auto and not jpeg_file):
        return "png", encode_png(sample.image), "png"
    if jpeg_file and file.data is not None:
        return "jpg", file.data, "jpg_copied"
    return "jpg", encode_jpeg(sample.image), "jpg_encoded"


def _resized(s: Sample, image: Image.Image) -> Sample:
    """``s`` with ``image``: its file's bytes kept only when the pixels did not change."""
    same = image is s.image or (image.size == s.image.size and image.tobytes() == (
        s.image.tobytes()))
    file = s.file if s.file is None or same else s.file.changed()
    return Sample(s.key, image, s.label, file)


def resize_short_side(image: Image.Image, side: int) -> Image.Image:
    """The image with its shorter side resized to ``side`` px (bicubic, antialiased).

    torchvision's ``Resize(side)`` on a PIL image (0.29, ``functional.resize``), which is PIL's
    ``resize`` at ``side`` x ``int(side * long / short)`` px (the longer side truncated), and the
    image itself when that is its size; here without importing torch (~500 MiB resident), which
    the build needs nowhere else. ``tests/data/test_photo_shards.py`` checks the pixels are
    torchvision's, bit for bit.

    Args:
        image: a PIL image.
        side: the new shorter side in px (> 0).

    Returns:
        A new image, or ``image`` when its size would not change.
    """
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(side * long / short)
    size = (side, new_long) if w <= h else (new_long, side)
    return image if size == (w, h) else image.resize(size, Image.Resampling.BICUBIC)


def center_square(image: Image.Image, side: int) -> Image.Image:
    """The centred ``side x side`` crop of an image at least ``side`` px a side.

    torchvision's ``CenterCrop(side)`` on a PIL image: the offsets are
    ``int(round((W - side) / 2))`` and ``int(round((H - side) / 2))``.
    """
    w, h = image.size
    top, left = int(round((h - side) / 2.0)), int(round((w - side) / 2.0))
    return image.crop((left, top, left + side, top + side))


def resize_samples(samples: Iterable[Sample], image_size: int) -> Iterator[Sample]:
    """Resize the shorter side to ``image_size`` (bicubic, antialiased), then center-crop square.

    Lazily, one sample at a time, keeping no reference to a sample once it is handed on (a
    ``map``: a generator's loop variable would hold the source image while the next decodes).

    Args:
        samples: source samples.
        image_size: output side in pixels (``data.image_size``); must be > 0.

    Returns:
        An iterator of samples with ``image_size`` x ``image_size`` images, same key, label
        and mode.
    """
    def one(s: Sample) -> Sample:
        return _resized(s, center_square(resize_short_side(s.image, image_size), image_size))

    return map(one, samples)


def limit_short_side(samples: Iterable[Sample], max_side: int) -> Iterator[Sample]:
    """Shrink images whose shorter side exceeds ``max_side`` so it equals it; no crop.

    The aspect ratio is kept (the longer side is truncated as torchvision's ``Resize(int)``
    does, :func:`resize_short_side`), so RandomResizedCrop later samples from the whole photo
    as in the official MoCo code.
    Images already within ``max_side`` are stored unchanged (never upsampled). Lazily, holding
    no sample once it is handed on (as :func:`resize_samples`).

    Args:
        samples: source samples.
        max_side: the largest shorter side in pixels (``data.max_side``); must be > 0.

    Returns:
        An iterator of samples with ``min(W, H) <= max_side``, same key, label and mode.
    """
    def one(s: Sample) -> Sample:
        if min(s.image.size) <= max_side:
            return s
        return _resized(s, resize_short_side(s.image, max_side))

    return map(one, samples)
