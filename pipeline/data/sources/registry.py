"""The one entry point: :func:`open_source` maps ``data.source`` to its reader."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from urllib.error import URLError

from pipeline.config import DataSource
from pipeline.data.manifest import Manifest
from pipeline.data.sources.base import DEFAULT_ROOTS, Source, SourceError, local_path
from pipeline.data.sources.checksum import Checksum
from pipeline.data.sources.cifar import CifarSource
from pipeline.data.sources.idx import FashionMnistSource
from pipeline.data.sources.imagefolder import ImageFolderSource
from pipeline.data.sources.stl10 import Stl10Source
from pipeline.data.sources.unlabelled import NoLabelsSource
from pipeline.data.sources.webdataset import WebDatasetSource
from pipeline.errors import InputError


def open_source(name: str, root: str | Path = "", *, download: bool = False,
                test_fraction: float = 0.2, seed: int = 0,
                checksums: Mapping[str, Checksum] | None = None, label_field: str = "cls",
                max_broken_fraction: float = 0.001,
                index: Manifest | None = None,
                exclude: Collection[str] = ()) -> Source:
    """Open a dataset by name (``data.source``).

    Args:
        name: a :class:`pipeline.config.DataSource` name.
        root: raw-data directory; "" = the source's default (``DEFAULT_ROOTS``).
        download: let torchvision download missing files (not for imagefolder).
        test_fraction: held-out share (ImageFolder without a train/test split on disk,
            webdataset).
        seed: held-out split seed (ImageFolder, webdataset).
        checksums: override the accepted digests per file name (fashion_mnist, cifar*; tests).
        label_field: webdataset: ``cls`` or a ``.json`` field (``data.label_field``).
        max_broken_fraction: webdataset: undecodable samples skipped (``data.max_broken_fraction``).
        index: webdataset: the set's index manifest, when the ``index_shards`` stage wrote one.
        exclude: imagefolder: files left out, relative to ``root`` (the broken files of the
            folder index, :func:`pipeline.data.folder_index.broken_in_folder`).

    Returns:
        The opened :class:`Source`.

    Raises:
        ValueError: unknown name (lists the known ones).
        SourceError: missing, malformed or unverified raw files; or a download
            (``data.download: true``) that could not reach its server (one line, naming it).
        ShardError: webdataset shards unreadable or with too many broken samples.
    """
    try:
        return _open(name, root, download=download, test_fraction=test_fraction, seed=seed,
                     checksums=checksums, label_field=label_field,
                     max_broken_fraction=max_broken_fraction, index=index, exclude=exclude)
    except (URLError, RuntimeError) as e:
        # torchvision's download without network: URLError (CIFAR, STL-10), or for MNIST-style
        # sets a RuntimeError "Error downloading <file>: Tried <mirror>, got: <URLError>"
        if isinstance(e, RuntimeError) and not str(e).startswith("Error downloading"):
            raise
        reason = e.reason if isinstance(e, URLError) else str(e).strip().splitlines()[-1]
        where = root or DEFAULT_ROOTS.get(name)
        raise SourceError(f"data.source {name}: downloading into {where} failed: {reason}; "
                          "without network, put the files there and set "
                          "data.download: false") from None


def _open(name: str, root: str | Path, *, download: bool, test_fraction: float, seed: int,
          checksums: Mapping[str, Checksum] | None, label_field: str,
          max_broken_fraction: float, index: Manifest | None,
          exclude: Collection[str]) -> Source:
    """:func:`open_source` without the translation of download errors."""
    if name == "fashion_mnist":
        return FashionMnistSource(root, download=download, checksums=checksums)
    if name in ("cifar10", "cifar100"):
        return CifarSource(root, fine100=name == "cifar100", download=download,
                           checksums=checksums)
    if name == "stl10":
        return Stl10Source(root, download=download)
    if name == "imagefolder":
        return ImageFolderSource(local_path(root) if str(root) else root,
                                 test_fraction=test_fraction, seed=seed, exclude=exclude)
    if name == "webdataset":
        return WebDatasetSource(str(root), label_field=label_field, test_fraction=test_fraction,
                                seed=seed, max_broken_fraction=max_broken_fraction, index=index)
    if name == "none":
        return NoLabelsSource()
    raise InputError(f"unknown data source {name!r}; known: {', '.join(DataSource.names())}")
