"""Shared helpers for the source tests: tiny files in each dataset's real on-disk format."""

from __future__ import annotations

import hashlib
import struct
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
