"""Dataset readers: every source yields :class:`Sample` ``(key, PIL image, label)`` per split.

One interface for five sources (``open_source(name, root)``):

========================  =====================================================================
``fashion_mnist``         the four idx ``.gz`` files (Debian ``dataset-fashion-mnist`` or
                          torchvision's download), checked against published checksums.
``cifar10``/``cifar100``  the official python pickle batches; md5-checked BEFORE unpickling.
``stl10``                 the official binary ``*_X.bin``/``*_y.bin`` files (no pickle).
``imagefolder``           ``root/<class>/**/*.jpg`` or ``root/{train,test}/<class>/...``.
========================  =====================================================================

Splits: ``pretrain`` (the images MoCo learns from: the train split; STL-10 train + unlabeled),
``train`` (labelled train split) and ``test``. Labels are ``0..C-1``; STL-10's unlabeled images
carry ``-1``.

Caps (``max_images``) take a seeded, class-stratified subset (per-class quotas by largest
remainder, so class proportions are kept to within one image), returned in source order unless
``shuffle=True``.

Security: the CIFAR python batches can only be read by unpickling, and unpickling runs code. A
file is therefore unpickled only after its md5 matches torchvision's published digest
(``CIFAR10.train_list`` etc.), and then with an unpickler that resolves only the numpy
reconstruction globals these files use, so a tampered or substituted file is rejected before any
of its bytes are interpreted. Tests inject their own checksum table for tiny files.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import pickle
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

SPLITS = ("pretrain", "train", "test")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
DEFAULT_ROOTS = {
    "fashion_mnist": "/usr/share/datasets/fashion-mnist",  # Debian package dataset-fashion-mnist
    "cifar10": "data/raw/cifar10",
    "cifar100": "data/raw/cifar100",
    "stl10": "data/raw/stl10",
}
_KEY_MAX_CHARS = 80  # USTAR member names are limited to 100 characters (key + extension)


class SourceError(ValueError):
    """Raw data that is missing, malformed or fails verification (message names the file)."""


class ChecksumError(SourceError):
    """A raw file whose digest matches none of the accepted ones."""


@dataclass(frozen=True)
class Sample:
    """One image of a split.

    Attributes:
        key: unique within the split; only ``[A-Za-z0-9_-]`` (safe as a WebDataset key).
        image: PIL image in the source's :attr:`Source.mode` (``"L"`` or ``"RGB"``).
        label: class index ``0..C-1``, or ``-1`` for an unlabelled image.
    """

    key: str
    image: Image.Image
    label: int


@dataclass(frozen=True)
class Checksum:
    """Accepted digests of one raw file; the file passes if ANY given digest matches.

    Attributes:
        md5: md5 of the file as stored (torchvision's published digests).
        sha256_gunzipped: sha256 of the gzip-decompressed content (survives re-compression, e.g.
            by Debian's packaging).
    """

    md5: str | None = None
    sha256_gunzipped: str | None = None


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


def _torchvision_cifar_checksums(cls_name: str) -> dict[str, Checksum]:
    from torchvision import datasets  # deferred: importing torchvision costs ~1 s

    cls = getattr(datasets, cls_name)
    table = {name: Checksum(md5=md5) for name, md5 in [*cls.train_list, *cls.test_list]}
    table[cls.meta["filename"]] = Checksum(md5=cls.meta["md5"])
    return table


def verify_file(path: str | Path, expected: Checksum) -> None:
    """Check a raw file against its accepted digests.

    Args:
        path: the file.
        expected: accepted digests (at least one must be set).

    Raises:
        SourceError: the file does not exist.
        ChecksumError: no accepted digest matches (message names the file and its digests).
    """
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"{path}: file not found")
    data = path.read_bytes()
    md5 = hashlib.md5(data).hexdigest()
    if expected.md5 is not None and md5 == expected.md5:
        return
    found = f"md5 {md5}"
    if expected.sha256_gunzipped is not None:
        try:
            sha = hashlib.sha256(gzip.decompress(data)).hexdigest()
        except (OSError, EOFError) as e:
            raise ChecksumError(f"{path}: not a valid gzip file ({e})") from None
        if sha == expected.sha256_gunzipped:
            return
        found += f", sha256 of decompressed content {sha}"
    raise ChecksumError(f"{path}: checksum mismatch ({found}; expected {expected}); the file is "
                        "corrupt or not the published one")


def _checked(directory: Path, name: str, table: Mapping[str, Checksum]) -> Path:
    if name not in table:
        raise ChecksumError(f"{directory / name}: no checksum known for this file")
    verify_file(directory / name, table[name])
    return directory / name


def select_indices(labels: np.ndarray, max_images: int, seed: int) -> np.ndarray:
    """Pick a seeded, class-stratified subset of indices, returned in ascending order.

    Each label value (``-1`` counts as its own group) gets ``floor(max_images * n_c / n)``
    images plus one for the groups with the largest remainders (ties: smaller label first), so
    proportions are kept to within one image.

    Args:
        labels: ``(N,)`` integer labels.
        max_images: how many to keep; ``0`` or ``>= N`` keeps all.
        seed: selects which images of each class are kept.

    Returns:
        ``(M,)`` int64 sorted indices into ``labels``.

    Raises:
        ValueError: ``max_images < 0``.
    """
    n = len(labels)
    if max_images < 0:
        raise ValueError(f"max_images must be >= 0, got {max_images}")
    if max_images == 0 or max_images >= n:
        return np.arange(n, dtype=np.int64)
    classes, counts = np.unique(labels, return_counts=True)
    exact = max_images * counts / n
    quota = np.floor(exact).astype(np.int64)
    short = max_images - int(quota.sum())
    order = sorted(range(len(classes)), key=lambda c: (-(exact[c] - quota[c]), c))
    for c in order[:short]:
        quota[c] += 1
    rng = np.random.default_rng([seed, 0])
    chosen = [rng.permutation(np.flatnonzero(labels == c))[:q] for c, q in zip(classes, quota)]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


class Source:
    """A dataset with ``pretrain``/``train``/``test`` splits of :class:`Sample`.

    Attributes:
        name: the source name (``open_source``'s first argument).
        class_names: ``C`` names, index = label.
        mode: ``"L"`` (1 channel) or ``"RGB"`` (3 channels); every yielded image has this mode.
        mean: per-channel normalisation mean on the 0..1 scale, or ``None`` when no published
            value exists (ImageFolder: ``build_all`` computes it from the pretrain split).
        std: per-channel normalisation std, or ``None`` (see ``mean``).
        native_shape: ``(C, H, W)`` when all images share one size, else ``None``.
    """

    name: str = ""
    class_names: tuple[str, ...] = ()
    mode: str = "L"
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    native_shape: tuple[int, int, int] | None = None

    def labels(self, split: str) -> np.ndarray:
        """Labels of a split, ``(N,)`` int64 (``-1`` = unlabelled), in source order."""
        raise NotImplementedError

    def _load(self, split: str, index: int) -> Sample:
        raise NotImplementedError

    def _check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")

    def count(self, split: str) -> int:
        """Number of images in a split."""
        return len(self.labels(split))

    def splits(self) -> dict[str, int]:
        """Image count per split, ``{"pretrain": N, "train": N, "test": N}``."""
        return {s: self.count(s) for s in SPLITS}

    def indices(self, split: str, *, max_images: int = 0, seed: int = 0,
                shuffle: bool = False) -> np.ndarray:
        """The source indices ``iter`` visits, in visiting order.

        Args:
            split: ``pretrain``, ``train`` or ``test``.
            max_images: cap (0 = all), see :func:`select_indices`.
            seed: seeds the subset and the shuffle.
            shuffle: visit in a seeded random order instead of source order.

        Returns:
            ``(M,)`` int64 indices.
        """
        self._check_split(split)
        idx = select_indices(self.labels(split), max_images, seed)
        if shuffle:
            idx = np.random.default_rng([seed, 1]).permutation(idx)
        return idx

    def iter(self, split: str, *, max_images: int = 0, seed: int = 0,
             shuffle: bool = False) -> Iterator[Sample]:
        """Yield the samples of a split (arguments as in :meth:`indices`).

        Raises:
            SourceError: images that cannot be decoded; raised after the last readable one,
                listing every bad path.
        """
        bad: list[str] = []
        for i in self.indices(split, max_images=max_images, seed=seed, shuffle=shuffle):
            try:
                yield self._load(split, int(i))
            except _UnreadableImage as e:
                bad.append(str(e))
        if bad:
            raise SourceError(f"{len(bad)} unreadable image(s): " + "; ".join(bad))


class _UnreadableImage(Exception):
    pass


# --- array-backed sources --------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """A contiguous block of a split: ``images[i]`` -> HW or HWC uint8 via ``to_hwc``."""

    prefix: str  # key prefix: train / test / unlabeled
    images: np.ndarray
    labels: np.ndarray
    to_hwc: Callable[[np.ndarray], np.ndarray] | None = None


class _ArraySource(Source):
    def __init__(self, parts: Mapping[str, Sequence[_Part]]):
        self._parts = {s: list(p) for s, p in parts.items()}
        self._labels = {s: np.concatenate([p.labels for p in ps]).astype(np.int64)
                        for s, ps in self._parts.items()}
        self._starts = {s: np.cumsum([0] + [len(p.labels) for p in ps])
                        for s, ps in self._parts.items()}

    def labels(self, split: str) -> np.ndarray:
        """Labels of a split, ``(N,)`` int64 (``-1`` = unlabelled), in source order."""
        self._check_split(split)
        return self._labels[split]

    def _load(self, split: str, index: int) -> Sample:
        k = int(np.searchsorted(self._starts[split], index, side="right")) - 1
        part, local = self._parts[split][k], index - int(self._starts[split][k])
        arr = part.images[local]
        if part.to_hwc is not None:
            arr = part.to_hwc(arr)
        image = Image.fromarray(np.ascontiguousarray(arr))
        return Sample(f"{part.prefix}_{local:06d}", image, int(part.labels[local]))


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """Parse a gzipped idx file (unsigned bytes, big-endian dims) into an array."""
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


class FashionMnistSource(_ArraySource):
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
        root = Path(root or DEFAULT_ROOTS[self.name])
        directory = _find_dir(root, ["", "FashionMNIST/raw"], list(FASHION_MNIST_CHECKSUMS))
        if directory is None and download:
            from torchvision.datasets import FashionMNIST

            for train in (True, False):
                FashionMNIST(str(root), train=train, download=True)
            directory = _find_dir(root, ["FashionMNIST/raw"], list(FASHION_MNIST_CHECKSUMS))
        if directory is None:
            raise SourceError(f"{root}: Fashion-MNIST files {sorted(FASHION_MNIST_CHECKSUMS)} not "
                              "found (install dataset-fashion-mnist or set data.download: true)")
        arrays = {}
        for name in FASHION_MNIST_CHECKSUMS:
            path = _checked(directory, name, table)
            arrays[name] = _read_idx(path, 3 if "images" in name else 1)
        parts = {}
        for prefix, stem in (("train", "train"), ("test", "t10k")):
            images = arrays[f"{stem}-images-idx3-ubyte.gz"]
            labels = arrays[f"{stem}-labels-idx1-ubyte.gz"]
            if len(images) != len(labels):
                raise SourceError(f"{directory}: {stem} has {len(images)} images, "
                                  f"{len(labels)} labels")
            _check_labels(labels, len(self.class_names), directory / f"{stem}-labels-idx1-ubyte.gz")
            parts[prefix] = _Part(prefix, images, labels)
        super().__init__({"pretrain": [parts["train"]], "train": [parts["train"]],
                          "test": [parts["test"]]})


def _find_dir(root: Path, subdirs: Sequence[str], names: Sequence[str]) -> Path | None:
    for sub in subdirs:
        d = root / sub
        if all((d / n).is_file() for n in names):
            return d
    return None


def _check_labels(labels: np.ndarray, num_classes: int, path: Path) -> None:
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise SourceError(f"{path}: labels outside 0..{num_classes - 1}")


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Resolves only the globals numpy arrays need; anything else is refused."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):  # noqa: D102
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            obj = _NumpyOnlyUnpickler(f, encoding="latin1").load()
    except Exception as e:  # any unpickling failure is a malformed file
        raise SourceError(f"{path}: cannot read the pickle batch ({e})") from None
    if not isinstance(obj, dict):
        raise SourceError(f"{path}: expected a dict, got {type(obj).__name__}")
    return obj


class CifarSource(_ArraySource):
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
        table = _torchvision_cifar_checksums(cls.__name__) if checksums is None else checksums
        root = Path(root or DEFAULT_ROOTS[self.name])
        train_names = [n for n, _ in cls.train_list]
        test_names = [n for n, _ in cls.test_list]
        names = [*train_names, *test_names, cls.meta["filename"]]
        directory = _find_dir(root, [cls.base_folder, ""], names)
        if directory is None and download:
            cls(str(root), train=True, download=True)
            directory = _find_dir(root, [cls.base_folder], names)
        if directory is None:
            raise SourceError(f"{root}: {self.name} files {names} not found in {root} or "
                              f"{root / cls.base_folder} (set data.download: true to fetch them)")
        meta = _unpickle(_checked(directory, cls.meta["filename"], table))
        if cls.meta["key"] not in meta:
            raise SourceError(f"{directory / cls.meta['filename']}: no '{cls.meta['key']}' entry")
        self.class_names = tuple(str(c) for c in meta[cls.meta["key"]])
        label_key = "fine_labels" if fine100 else "labels"

        def read(names_: list[str], prefix: str) -> _Part:
            images, labels = [], []
            for n in names_:
                path = _checked(directory, n, table)
                batch = _unpickle(path)
                data = np.asarray(batch.get("data", []), dtype=np.uint8)
                lab = np.asarray(batch.get(label_key, []), dtype=np.int64)
                if data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(lab):
                    raise SourceError(f"{path}: expected 'data' (N, 3072) and N '{label_key}', "
                                      f"got {data.shape} and {lab.shape}")
                _check_labels(lab, len(self.class_names), path)
                images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))  # N,H,W,C
                labels.append(lab)
            return _Part(prefix, np.concatenate(images), np.concatenate(labels))

        train, test = read(train_names, "train"), read(test_names, "test")
        super().__init__({"pretrain": [train], "train": [train], "test": [test]})


class Stl10Source(_ArraySource):
    """STL-10 (Coates et al. 2011): 5000 train / 8000 test / 100000 unlabeled, 96x96 RGB.

    The ``.bin`` files are memory-mapped (unlabeled_X.bin is 2.7 GB). Each image is stored as
    3 x 96 x 96 bytes, channel-major and column-major (as torchvision's ``STL10`` reads it);
    labels are stored 1..10 and returned as 0..9. There is no per-file published checksum
    (torchvision checks only the archive), and no file is unpickled, so files are checked by
    size and label range.
    """

    name = "stl10"
    mode = "RGB"
    mean = (0.4467, 0.4398, 0.4066)  # commonly used STL-10 pixel statistics
    std = (0.2603, 0.2566, 0.2713)
    native_shape = (3, 96, 96)
    _IMAGE_BYTES = 3 * 96 * 96

    def __init__(self, root: str | Path = "", *, download: bool = False):
        """Map the binary files.

        Args:
            root: directory holding ``stl10_binary/`` or the ``.bin`` files; "" =
                ``data/raw/stl10``.
            download: let torchvision download and extract the archive into ``root``.

        Raises:
            SourceError: files missing, of the wrong size, or labels outside 1..10.
        """
        names = ["train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin", "unlabeled_X.bin",
                 "class_names.txt"]
        root = Path(root or DEFAULT_ROOTS[self.name])
        directory = _find_dir(root, ["stl10_binary", ""], names)
        if directory is None and download:
            from torchvision.datasets import STL10

            STL10(str(root), split="train", download=True)
            directory = _find_dir(root, ["stl10_binary"], names)
        if directory is None:
            raise SourceError(f"{root}: STL-10 files {names} not found in {root} or "
                              f"{root / 'stl10_binary'} (set data.download: true to fetch them)")
        self.class_names = tuple(
            line.strip() for line in (directory / "class_names.txt").read_text().splitlines()
            if line.strip())
        if len(self.class_names) != 10:
            raise SourceError(f"{directory / 'class_names.txt'}: expected 10 class names, "
                              f"found {len(self.class_names)}")
        parts = {p: self._part(directory, p) for p in ("train", "test", "unlabeled")}
        super().__init__({"pretrain": [parts["train"], parts["unlabeled"]],
                          "train": [parts["train"]], "test": [parts["test"]]})

    def _part(self, directory: Path, prefix: str) -> _Part:
        xpath = directory / f"{prefix}_X.bin"
        nbytes = xpath.stat().st_size
        if nbytes == 0 or nbytes % self._IMAGE_BYTES:
            raise SourceError(f"{xpath}: {nbytes} bytes is not a positive multiple of "
                              f"{self._IMAGE_BYTES} (3x96x96)")
        images = np.memmap(xpath, dtype=np.uint8, mode="r").reshape(-1, 3, 96, 96)
        if prefix == "unlabeled":
            labels = np.full(len(images), -1, dtype=np.int64)
        else:
            ypath = directory / f"{prefix}_y.bin"
            labels = np.fromfile(ypath, dtype=np.uint8).astype(np.int64)
            if len(labels) != len(images):
                raise SourceError(f"{ypath}: {len(labels)} labels for {len(images)} images")
            if len(labels) and (labels.min() < 1 or labels.max() > 10):
                raise SourceError(f"{ypath}: labels outside 1..10")
            labels = labels - 1
        # stored (C, W, H) per image, i.e. column-major: -> (H, W, C)
        return _Part(prefix, images, labels, to_hwc=_chw_colmajor_to_hwc)


def _chw_colmajor_to_hwc(a: np.ndarray) -> np.ndarray:
    return a.transpose(2, 1, 0)


# --- ImageFolder -----------------------------------------------------------------------------

_GREY_MODES = ("1", "L", "LA", "La")


def _to_mode(image: Image.Image, mode: str) -> Image.Image:
    """Convert any PIL mode to ``mode`` ("L" or "RGB"); transparency is composited on white."""
    if image.mode == "P":  # palette: keep its transparency, if any, as alpha
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "La", "RGBa", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return image if image.mode == mode else image.convert(mode)


def _sanitize_key(relpath: str) -> str:
    stem = relpath.rsplit(".", 1)[0]
    return re.sub(r"[^A-Za-z0-9_-]+", "_", stem).strip("_")[:_KEY_MAX_CHARS]


class ImageFolderSource(Source):
    """Images in class sub-folders, optionally under ``train/`` and ``test/`` (or ``val/``).

    Layout: ``root/<class>/**/<image>`` (any nesting inside a class folder) is split into train
    and test per class with a seeded shuffle (``round(n_c * test_fraction)`` test images per
    class); ``root/train/<class>/...`` + ``root/test/<class>/...`` (``val`` accepted for
    ``test``) is used as given. Files with extensions .jpg .jpeg .png .webp .bmp (any case) are
    images; hidden files and folders are ignored. Order is sorted by relative path.

    Modes: the dataset mode is ``"L"`` when every image is grey (PIL modes 1, L, LA) and
    ``"RGB"`` otherwise; each image is converted with PIL (palette -> RGB(A), CMYK -> RGB without
    colour management, RGB -> L by ITU-R 601-2 luma), and transparency is composited onto white,
    so transparent regions look as they do on a white page rather than exposing undefined
    colour under alpha 0.

    Keys: ``<7-digit index>_<relative path without extension, non [A-Za-z0-9_-] -> '_'>``,
    truncated so tar member names stay under USTAR's 100 characters; unique by the index.

    There are no published normalisation statistics: :attr:`mean`/:attr:`std` are ``None`` and
    ``build_all`` records the pixel statistics of the pretrain split instead.
    """

    name = "imagefolder"

    def __init__(self, root: str | Path, *, test_fraction: float = 0.2, seed: int = 0):
        """Scan the folders and every image header.

        Args:
            root: the dataset directory (required).
            test_fraction: share of each class held out as test when there is no train/test
                split on disk; ``0 < x < 1``.
            seed: seeds that held-out split.

        Raises:
            SourceError: no root, no class folders, an empty class folder, a test class unknown
                to train, images whose header cannot be read (all bad paths listed), or a
                ``test_fraction`` that leaves a split empty.
        """
        if not str(root):
            raise SourceError("imagefolder: data.root must name the image directory")
        self.root = Path(root)
        if not self.root.is_dir():
            raise SourceError(f"{self.root}: not a directory")
        if not 0 < test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        subdirs = {d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith(".")}
        held_out = "test" if "test" in subdirs else "val" if "val" in subdirs else None
        if "train" in subdirs and held_out:
            classes, train = _scan_classes(self.root / "train")
            test_classes, test = _scan_classes(self.root / held_out)
            unknown = sorted(set(test_classes) - set(classes))
            if unknown:
                raise SourceError(f"{self.root / held_out}: classes {unknown} are not in "
                                  f"{self.root / 'train'}")
            remap = [classes.index(c) for c in test_classes]
            test = [(p, remap[y]) for p, y in test]
            files = {"train": train, "test": test}
        else:
            classes, items = _scan_classes(self.root)
            files = _split_per_class(items, len(classes), test_fraction, seed)
            for split, f in files.items():
                if not f:
                    raise SourceError(f"{self.root}: test_fraction={test_fraction} leaves the "
                                      f"{split} split empty")
        files["pretrain"] = files["train"]
        self.class_names = tuple(classes)
        self._files = {s: sorted(f) for s, f in files.items()}
        self._scan_headers()

    def _scan_headers(self) -> None:
        modes: set[str] = set()
        sizes: set[tuple[int, int]] = set()
        bad = []
        for path, _ in sorted(set(self._files["train"]) | set(self._files["test"])):
            try:
                with Image.open(path) as im:
                    modes.add(im.mode)
                    sizes.add(im.size)
            except Exception as e:  # PIL raises several types for unreadable files
                bad.append(f"{path} ({type(e).__name__})")
        if bad:
            raise SourceError(f"{len(bad)} unreadable image(s): " + "; ".join(bad))
        self.mode = "L" if modes <= set(_GREY_MODES) else "RGB"
        channels = 1 if self.mode == "L" else 3
        if len(sizes) == 1:
            (w, h), = sizes
            self.native_shape = (channels, h, w)

    def labels(self, split: str) -> np.ndarray:
        """Labels of a split, ``(N,)`` int64, in sorted path order."""
        self._check_split(split)
        return np.array([y for _, y in self._files[split]], dtype=np.int64)

    def _load(self, split: str, index: int) -> Sample:
        path, label = self._files[split][index]
        try:
            with Image.open(path) as im:
                im.load()
                image = _to_mode(im, self.mode)
        except Exception as e:  # truncated / corrupt data past the header
            raise _UnreadableImage(f"{path} ({type(e).__name__}: {e})") from None
        rel = os.path.relpath(path, self.root)
        return Sample(f"{index:07d}_{_sanitize_key(rel)}", image, label)


def _scan_classes(directory: Path) -> tuple[list[str], list[tuple[str, int]]]:
    classes = sorted(d.name for d in directory.iterdir()
                     if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise SourceError(f"{directory}: no class sub-folders")
    items, empty = [], []
    for label, cls in enumerate(classes):
        found = []
        for dirpath, dirnames, filenames in os.walk(directory / cls):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            found += [os.path.join(dirpath, f) for f in filenames
                      if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS)]
        if not found:
            empty.append(str(directory / cls))
        items += [(p, label) for p in sorted(found)]
    if empty:
        raise SourceError(f"class folder(s) without images ({', '.join(IMAGE_EXTENSIONS)}): "
                          + ", ".join(empty))
    return classes, items


def _split_per_class(items: list[tuple[str, int]], num_classes: int, test_fraction: float,
                     seed: int) -> dict[str, list[tuple[str, int]]]:
    rng = np.random.default_rng([seed, 2])
    by_class: list[list[tuple[str, int]]] = [[] for _ in range(num_classes)]
    for item in items:
        by_class[item[1]].append(item)
    out: dict[str, list[tuple[str, int]]] = {"train": [], "test": []}
    for members in by_class:
        members.sort()
        n_test = int(len(members) * test_fraction + 0.5)
        perm = rng.permutation(len(members))
        out["test"] += [members[i] for i in perm[:n_test]]
        out["train"] += [members[i] for i in perm[n_test:]]
    return out


# --- factory ---------------------------------------------------------------------------------

SOURCE_NAMES = ("fashion_mnist", "cifar10", "cifar100", "stl10", "imagefolder")


def open_source(name: str, root: str | Path = "", *, download: bool = False,
                test_fraction: float = 0.2, seed: int = 0,
                checksums: Mapping[str, Checksum] | None = None) -> Source:
    """Open a dataset by name (``data.source``).

    Args:
        name: one of :data:`SOURCE_NAMES`.
        root: raw-data directory; "" = the source's default (:data:`DEFAULT_ROOTS`).
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
    raise ValueError(f"unknown data source {name!r}; known: {', '.join(SOURCE_NAMES)}")
