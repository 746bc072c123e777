"""CIFAR-10 / CIFAR-100 from the official python pickle batches, md5-checked BEFORE unpickling.

Security: these batches can only be read by unpickling, and unpickling runs code. A file is
therefore unpickled only after its md5 matches torchvision's published digest
(``CIFAR10.train_list`` etc.), and then with an unpickler that resolves only the numpy
reconstruction globals these files use, so a tampered or substituted file is rejected before any
of its bytes are interpreted. Tests inject their own checksum table for tiny files.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.sources.base import (
    DEFAULT_ROOTS,
    ArraySource,
    Part,
    SourceError,
    check_labels,
    find_dir,
)
from pipeline.data.sources.checksum import Checksum, checked


def torchvision_cifar_checksums(cls_name: str) -> dict[str, Checksum]:
    """Torchvision's published md5 for every file of ``CIFAR10`` or ``CIFAR100`` (``cls_name``)."""
    from torchvision import datasets  # deferred: importing torchvision costs ~1 s

    cls = getattr(datasets, cls_name)
    table = {name: Checksum(md5=md5) for name, md5 in [*cls.train_list, *cls.test_list]}
    table[cls.meta["filename"]] = Checksum(md5=cls.meta["md5"])
    return table


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Resolves only the globals numpy arrays need; anything else is refused."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):  # noqa: D102
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")
        return super().find_class(module, name)


def unpickle(path: Path) -> dict:
    """Unpickle a (verified) CIFAR batch with :class:`_NumpyOnlyUnpickler`.

    Raises:
        SourceError: the file cannot be unpickled, references a non-numpy global, or is not a
            dict (names the file).
    """
    try:
        with open(path, "rb") as f:
            obj = _NumpyOnlyUnpickler(f, encoding="latin1").load()
    except Exception as e:  # any unpickling failure is a malformed file
        raise SourceError(f"{path}: cannot read the pickle batch ({e})") from None
    if not isinstance(obj, dict):
        raise SourceError(f"{path}: expected a dict, got {type(obj).__name__}")
    return obj


class CifarSource(ArraySource):
    """CIFAR-10 / CIFAR-100 (Krizhevsky 2009): 50000 train / 10000 test, 32x32 RGB."""

    mode = "RGB"
    native_shape = (3, 32, 32)

    def __init__(self, root: str | Path = "", *, fine100: bool = False, download: bool = False,
                 checksums: Mapping[str, Checksum] | None = None):
        """Verify then read the official python batches.

        Args:
            root: directory holding ``cifar-10-batches-py/`` (``cifar-100-python/``) or the batch
                files themselves; "" = ``data/raw/cifar10`` (``data/raw/cifar100``).
            fine100: CIFAR-100 with its 100 fine labels instead of CIFAR-10.
            download: let torchvision download and extract the archive into ``root``.
            checksums: accepted md5 per file name (default: torchvision's published md5s).

        Raises:
            SourceError: files missing or malformed; ChecksumError before unpickling a file whose
                md5 does not match.
        """
        from torchvision import datasets

        cls = datasets.CIFAR100 if fine100 else datasets.CIFAR10
        self.name = "cifar100" if fine100 else "cifar10"
        if fine100:  # commonly used CIFAR-100 train-set pixel statistics
            self.mean, self.std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
        else:  # CIFAR-10 train-set pixel mean/std (the std over all pixels, not per image)
            self.mean, self.std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
        self._table = torchvision_cifar_checksums(cls.__name__) if checksums is None else checksums
        self._label_key = "fine_labels" if fine100 else "labels"
        self._dir = self._locate(cls, Path(root or DEFAULT_ROOTS[self.name]), download)
        meta = unpickle(checked(self._dir, cls.meta["filename"], self._table))
        if cls.meta["key"] not in meta:
            raise SourceError(f"{self._dir / cls.meta['filename']}: no '{cls.meta['key']}' entry")
        self.class_names = tuple(str(c) for c in meta[cls.meta["key"]])
        train = self._read([n for n, _ in cls.train_list], "train")
        test = self._read([n for n, _ in cls.test_list], "test")
        super().__init__({"pretrain": [train], "train": [train], "test": [test]})

    def _locate(self, cls: Any, root: Path, download: bool) -> Path:
        """The directory holding every batch and the meta file, downloading first if allowed."""
        names = [*(n for n, _ in cls.train_list), *(n for n, _ in cls.test_list),
                 cls.meta["filename"]]
        directory = find_dir(root, [cls.base_folder, ""], names)
        if directory is None and download:
            cls(str(root), train=True, download=True)
            directory = find_dir(root, [cls.base_folder], names)
        if directory is None:
            raise SourceError(f"{root}: {self.name} files {names} not found in {root} or "
                              f"{root / cls.base_folder} (set data.download: true to fetch them)")
        return directory

    def _read(self, names: list[str], prefix: str) -> Part:
        """Verify and read the batches ``names`` into one part of ``(N, 32, 32, 3)`` images."""
        images, labels = [], []
        for n in names:
            path = checked(self._dir, n, self._table)
            batch = unpickle(path)
            data = np.asarray(batch.get("data", []), dtype=np.uint8)
            lab = np.asarray(batch.get(self._label_key, []), dtype=np.int64)
            if data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(lab):
                raise SourceError(f"{path}: expected 'data' (N, 3072) and N '{self._label_key}', "
                                  f"got {data.shape} and {lab.shape}")
            check_labels(lab, len(self.class_names), path)
            images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))  # N,H,W,C
            labels.append(lab)
        return Part(prefix, np.concatenate(images), np.concatenate(labels))
