"""Shared helpers for the source tests: tiny files in each dataset's real on-disk format."""

from __future__ import annotations

import hashlib
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.data.sources import Checksum

KEY_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def md5_table(directory: Path) -> dict[str, Checksum]:
    return {p.name: Checksum(md5=hashlib.md5(p.read_bytes()).hexdigest())
            for p in directory.iterdir() if p.is_file()}


def idx_bytes(array: np.ndarray) -> bytes:
    magic = 0x0800 + array.ndim  # unsigned byte, ndim dimensions (big-endian header)
    return struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape) + \
        array.astype(np.uint8).tobytes()


def save(path: Path, image: Image.Image, fmt: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format=fmt)


def png_bytes(width: int, height: int, bit_depth: int, colour_type: int, rows: list[bytes],
              trns: bytes | None = None) -> bytes:
    """A minimal PNG written chunk by chunk (IHDR, optional tRNS, IDAT, IEND), for layouts PIL
    cannot save itself: 16-bit grey+alpha, 16-bit RGB, 16-bit grey with a transparent value.

    ``rows``: the raw big-endian bytes of each scanline (filter byte 0 is added here).
    """

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    raw = b"".join(b"\x00" + r for r in rows)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + (chunk(b"tRNS", trns) if trns is not None else b"")
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
