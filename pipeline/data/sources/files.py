"""Image files as the sources read them: upright pixels, and header or decode scans.

:func:`open_upright` gives a file's pixels as displayed (EXIF orientation applied, as every
decode does: :func:`pipeline.data.external.open_image`) and says whether its JPEG bytes still
describe them; :func:`read_images` and :func:`scan_headers` read
every file's header (or decode it, at 1/8 scale for a JPEG) and name the broken ones. Used by
the ImageFolder and unlabelled-tree sources and by the folder index.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from pipeline.data.external import open_image, upright_size
from pipeline.data.modes import SUPPORTED_MODES, ModeError, image_kind, to_mode
from pipeline.data.sources.base import (
    BrokenImages,
    SourceFile,
    UnreadableImage,
    keeps_pixels,
    name_bad_files,
    shown_path,
)


def open_upright(path: str, mode: str) -> tuple[Image.Image, SourceFile]:
    """An image file decoded, turned upright by its EXIF orientation, then converted to ``mode``.

    Returns:
        ``(image, file)``: the image in ``mode``, and the file it came from
        (:class:`~pipeline.data.sources.base.SourceFile`), with its bytes when they decode to
        exactly this image: a JPEG whose mode is ``mode`` (or ``L`` in an ``RGB`` folder,
        :func:`keeps_pixels`), whatever its EXIF orientation: every reader turns it as this
        does (:func:`~pipeline.data.external.open_image`). Only JPEGs keep their bytes:
        ``build_shards`` stores every other format as PNG.

    Raises:
        UnreadableImage: the pixels cannot be decoded or converted (names the file).
    """
    try:
        data = Path(path).read_bytes()
        with open_image(data) as im:  # upright (EXIF orientation applied)
            kept = im.format == "JPEG" and keeps_pixels(im.mode, mode)
            file = SourceFile(str(im.format), data if kept else None)
            return to_mode(im, mode), file
    except ModeError as e:  # e.g. float values outside 0..1
        raise UnreadableImage(f"{shown_path(path)} ({e})") from None
    except Exception as e:  # truncated / corrupt data past the header
        raise UnreadableImage(f"{shown_path(path)} ({type(e).__name__}: {e})") from None


@dataclass
class ImageScan:
    """What :func:`read_images` found in a list of image files.

    Attributes:
        kinds: the :func:`pipeline.data.modes.image_kind` values of the good files.
        sizes: their distinct upright ``(W, H)`` (:func:`upright_size`).
        bad: ``{path: "<shown path> (<reason>)"}`` of the files that do not decode, in the order
            read; the reason is the error type for a header, ``"<type>: <message>"`` for pixel
            data (``OSError: image file is truncated``).
        unsupported: ``"<shown path> (<why>)"`` of the files in a mode outside
            :data:`pipeline.data.modes.SUPPORTED_MODES`.
    """

    kinds: set[str] = field(default_factory=set)
    sizes: set[tuple[int, int]] = field(default_factory=set)
    bad: dict[str, str] = field(default_factory=dict)
    unsupported: list[str] = field(default_factory=list)

    def problems(self, *, with_bad: bool = True) -> str:
        """One line naming the bad files (unless not ``with_bad``) and the unsupported ones.

        ``""`` when there are none. Past :data:`pipeline.data.sources.base.MAX_NAMED` of a
        kind, the rest are counted and every one is logged
        (:func:`pipeline.data.sources.base.name_bad_files`).
        """
        parts = []
        if self.bad and with_bad:
            parts.append(name_bad_files("unreadable image(s)", list(self.bad.values())))
        if self.unsupported:
            parts.append(name_bad_files("image(s) in an unsupported mode", self.unsupported)
                         + f" (supported PIL modes: {', '.join(SUPPORTED_MODES)})")
        return "; ".join(parts)  # both kinds in one line: one run names every file to fix


def read_images(paths: Iterable[str], *, decode: bool = False) -> ImageScan:
    """Read the header of every image file: its kind (grey or colour) and upright size.

    Palette images are decoded (their used colours decide grey or colour). Without ``decode``
    other pixels are not, so a file cut short after its header passes and fails when it is
    decoded; with it every file's pixel data is decoded too (a JPEG at 1/8 scale by libjpeg's
    DCT scaling, which still reads every byte; ``benchmarks/folder_check.py`` times it).

    Args:
        paths: image files.
        decode: also decode the pixel data, to find files cut short or corrupt past a good
            header (``index_shards`` does, before ``build_shards`` deletes the shards).

    Returns:
        The :class:`ImageScan`; nothing is raised for a bad file. A symlink to nothing (its
        reason names the target), a file that cannot be stat'ed or one that is not a regular
        file (a FIFO, which would block the read) is a bad file.
    """
    scan = ImageScan()
    for path in paths:
        if os.path.islink(path) and not os.path.exists(path):
            scan.bad[path] = (f"{shown_path(path)} (a symlink to nothing: "
                              f"{shown_path(os.readlink(path))})")
            continue
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # opening a FIFO waits for a writer
                scan.bad[path] = f"{shown_path(path)} (not a regular file)"
                continue
            with Image.open(path) as im:
                kind, size = image_kind(im), upright_size(im)
            if decode:
                _decode(path, kind)
        except ModeError as e:
            scan.unsupported.append(f"{shown_path(path)} ({e})")
            continue
        except PixelError as e:
            scan.bad[path] = f"{shown_path(path)} ({e})"
            continue
        except Exception as e:  # PIL raises several types for unreadable files
            scan.bad[path] = f"{shown_path(path)} ({type(e).__name__})"
            continue
        scan.kinds.add(kind)
        scan.sizes.add(size)
    return scan


def scan_headers(paths: Iterable[str], *, decode: bool = False
                 ) -> tuple[set[str], set[tuple[int, int]]]:
    """:func:`read_images`, stopping at any bad or unsupported file.

    Returns:
        ``(kinds, sizes)`` (:class:`ImageScan`).

    Raises:
        BrokenImages: one line naming every file whose header (or, with ``decode``, pixel data)
            does not decode (``"2 unreadable image(s): <path> (<error type>); ..."``) and every
            file in an unsupported mode (:meth:`ImageScan.problems`).
    """
    scan = read_images(paths, decode=decode)
    if scan.bad or scan.unsupported:
        raise BrokenImages(scan.problems())
    return scan.kinds, scan.sizes


class PixelError(Exception):
    """Pixel data past a good header that does not decode; the message is the reason."""


def _decode(path: str, kind: str) -> None:
    """Decode an image file as the build does, a JPEG at its smallest DCT scale (1/8).

    The pixels, turned by their EXIF orientation, and the conversion to ``kind`` (``"L"`` or
    ``"RGB"``), as :func:`open_upright`: so a value range the build refuses (``F`` outside
    0..1) or an EXIF block that does not parse is found here too. The file is opened afresh:
    the header scan's EXIF, read before the pixels, misses a PNG ``eXIf`` chunk after them.

    Raises:
        PixelError: ``"<error type>: <message>"``, e.g. ``OSError: image file is truncated``;
            the message alone for a refused value range.
    """
    try:
        with open_image(Path(path).read_bytes(), reduce=lambda _: 8) as im:
            to_mode(im, kind)
    except ModeError as e:  # e.g. float values outside 0..1
        raise PixelError(str(e)) from None
    except Exception as e:  # truncated / corrupt data past the header
        raise PixelError(f"{type(e).__name__}: {e}") from None
