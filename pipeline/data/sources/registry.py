"""The one entry point: :func:`open_source` maps ``data.source`` to its reader."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pipeline.config import DataSource
from pipeline.data.sources.base import Source
from pipeline.data.sources.checksum import Checksum
from pipeline.data.sources.cifar import CifarSource
from pipeline.data.sources.idx import FashionMnistSource
from pipeline.data.sources.imagefolder import ImageFolderSource
from pipeline.data.sources.stl10 import Stl10Source


def open_source(name: str, root: str | Path = "", *, download: bool = False,
                test_fraction: float = 0.2, seed: int = 0,
                checksums: Mapping[str, Checksum] | None = None) -> Source:
    """Open a dataset by name (``data.source``).

    Args:
        name: a :class:`pipeline.config.DataSource` name.
        root: raw-data directory; "" = the source's default (``DEFAULT_ROOTS``).
        download: let torchvision download missing files (not for imagefolder).
        test_fraction: ImageFolder held-out share when there is no train/test split on disk.
        seed: ImageFolder held-out split seed.
        checksums: override the accepted digests per file name (fashion_mnist, cifar*; tests).

    Returns:
        The opened :class:`Source`.

    Raises:
        ValueError: unknown name (lists the known ones).
        SourceError: missing, malformed or unverified raw files.
    """
    if name == "fashion_mnist":
        return FashionMnistSource(root, download=download, checksums=checksums)
    if name in ("cifar10", "cifar100"):
        return CifarSource(root, fine100=name == "cifar100", download=download,
                           checksums=checksums)
    if name == "stl10":
        return Stl10Source(root, download=download)
    if name == "imagefolder":
        return ImageFolderSource(root, test_fraction=test_fraction, seed=seed)
    raise ValueError(f"unknown data source {name!r}; known: {', '.join(DataSource.names())}")
