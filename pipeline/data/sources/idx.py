"""Fashion-MNIST from its four gzipped idx files (the LeCun MNIST format).

The files come from the Debian package ``dataset-fashion-mnist`` (re-gzipped, so they pass by
the sha256 of their decompressed content) or from torchvision's download (they pass by md5).
"""

from __future__ import annotations

import gzip
from collections.abc import Mapping
from pathlib import Path

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

# torchvision.datasets.FashionMNIST.resources (md5 of the .gz) + sha256 of the decompressed idx.
FASHION_MNIST_CHECKSUMS: dict[str, Checksum] = {
    "train-images-idx3-ubyte.gz": Checksum(
        "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"),
    "train-labels-idx1-ubyte.gz": Checksum(
        "25c81989df183df01b3e8a0aad5dffbe",
        "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"),
    "t10k-images-idx3-ubyte.gz": Checksum(
        "bef4ecab320f06d8554ea6380940ec79",
        "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"),
    "t10k-labels-idx1-ubyte.gz": Checksum(
        "bb300cfdad3c16e7a12a480ee83cd310",
        "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"),
}
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                         "Sneaker", "Bag", "Ankle boot")


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """Parse a gzipped idx file (unsigned bytes, big-endian dims) into an array.

    Args:
        path: the ``.gz`` file.
        ndim: expected number of dimensions (3 for images, 1 for labels).

    Returns:
        ``uint8`` array of the header's shape, e.g. ``(N, 28, 28)`` or ``(N,)``.

    Raises:
        SourceError: not gzip, wrong magic number, or a size that disagrees with the header.
    """
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as e:
        raise SourceError(f"{path}: not a valid gzip file ({e})") from None
    magic = int.from_bytes(data[:4], "big") if len(data) >= 4 else -1
    if magic != 0x0800 + ndim:  # 0x08 = unsigned byte, low byte = number of dims
        raise SourceError(f"{path}: not an idx{ndim}-ubyte file (magic {magic:#x})")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 * (ndim + 1)
    if len(data) - offset != int(np.prod(dims)):
        raise SourceError(f"{path}: {len(data) - offset} data bytes, header says dims {dims}")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(dims)


class FashionMnistSource(ArraySource):
    """Fashion-MNIST (Xiao et al. 2017): 60000 train / 10000 test, 28x28 grey, 10 classes."""

    name = "fashion_mnist"
    class_names = FASHION_MNIST_CLASSES
    mode = "L"
    mean = (0.2860,)  # commonly used Fashion-MNIST train-set statistics
    std = (0.3530,)
    native_shape = (1, 28, 28)

    def __init__(self, root: str | Path = "", *, download: bool = False,
                 checksums: Mapping[str, Checksum] | None = None):
        """Read and verify the four idx files.

        Args:
            root: directory holding the ``*-idx?-ubyte.gz`` files (or torchvision's
                ``root/FashionMNIST/raw``); "" = ``/usr/share/datasets/fashion-mnist``.
            download: let torchvision download the files into ``root`` when they are missing.
            checksums: accepted digests per file name (default
                :data:`FASHION_MNIST_CHECKSUMS`).

        Raises:
            SourceError: files missing, malformed or failing the checksum (names the file).
        """
        table = FASHION_MNIST_CHECKSUMS if checksums is None else checksums
        directory = self._locate(Path(root or DEFAULT_ROOTS[self.name]), download)
        arrays = {}
        for name in FASHION_MNIST_CHECKSUMS:
            path = checked(directory, name, table)
            arrays[name] = read_idx(path, 3 if "images" in name else 1)
        parts = {}
        for prefix, stem in (("train", "train"), ("test", "t10k")):
            images = arrays[f"{stem}-images-idx3-ubyte.gz"]
            labels = arrays[f"{stem}-labels-idx1-ubyte.gz"]
            if len(images) != len(labels):
                raise SourceError(f"{directory}: {stem} has {len(images)} images, "
                                  f"{len(labels)} labels")
            check_labels(labels, len(self.class_names), directory / f"{stem}-labels-idx1-ubyte.gz")
            parts[prefix] = Part(prefix, images, labels)
        super().__init__({"pretrain": [parts["train"]], "train": [parts["train"]],
                          "test": [parts["test"]]})

    @staticmethod
    def _locate(root: Path, download: bool) -> Path:
        """The directory holding the four files, downloading them first if allowed."""
        names = list(FASHION_MNIST_CHECKSUMS)
        directory = find_dir(root, ["", "FashionMNIST/raw"], names)
        if directory is None and download:
            from torchvision.datasets import FashionMNIST

            for train in (True, False):
                FashionMNIST(str(root), train=train, download=True)
            directory = find_dir(root, ["FashionMNIST/raw"], names)
        if directory is None:
            raise SourceError(f"{root}: Fashion-MNIST files {sorted(names)} not "
                              "found (install dataset-fashion-mnist or set data.download: true)")
        return directory
