"""The shared base of every dataset reader: :class:`Sample`, :class:`Source`, errors, caps.

Also the array-backed machinery the three array datasets (idx, CIFAR, STL-10) share:
:class:`ArraySource` serves a split as contiguous :class:`Part` blocks of a ``uint8`` array.
Names without a leading underscore here are used across the package but are not re-exported
by ``pipeline.data.sources`` unless listed in its ``__all__``.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
from PIL import Image

from pipeline.errors import InputError

SPLITS = ("pretrain", "train", "test")
DEFAULT_ROOTS = {
    "fashion_mnist": "/usr/share/datasets/fashion-mnist",  # Debian package dataset-fashion-mnist
    "cifar10": "data/raw/cifar10",
    "cifar100": "data/raw/cifar100",
    "stl10": "data/raw/stl10",
}


MAX_NAMED = 10  # files named in one error line; the rest are counted there and logged
log = logging.getLogger(__name__)


class SourceError(InputError):
    """Raw data that is missing, malformed or fails verification (message names the file)."""


def shown_path(path: str) -> str:
    r"""A file name as it can be printed on one line and typed back.

    Names that hold a control character (a newline) or bytes that are not UTF-8 (decoded by
    Python with ``surrogateescape``) are shown as the Python bytes literal of their
    file-system encoding, e.g. ``b'photos/caf\xe9.jpg'``; other names as they are.
    """
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return repr(os.fsencode(path))
    return path if path.isprintable() else repr(os.fsencode(path))


def name_bad_files(what: str, items: Sequence[str]) -> str:
    """``"<N> <what>: <item>; <item>; ..."`` for one error line, at most :data:`MAX_NAMED` named.

    With more items the line names the first :data:`MAX_NAMED`, then ``"... and <M> more
    (all <N> logged above)"``, and every item is logged at ERROR, one per line and in the
    singular (``"unreadable image: <item>"``), so a folder of thousands of broken files gives a
    readable error line and still the full list.

    Args:
        what: the plural noun phrase, e.g. ``"unreadable image(s)"``.
        items: one ``"<path> (<reason>)"`` per file, in the order found.
    """
    if len(items) > MAX_NAMED:
        one = what.replace("(s)", "")  # a log line names one file
        for item in items:
            log.error("%s: %s", one, item)
        rest = f"; ... and {len(items) - MAX_NAMED} more (all {len(items)} logged above)"
        return f"{len(items)} {what}: " + "; ".join(items[:MAX_NAMED]) + rest
    return f"{len(items)} {what}: " + "; ".join(items)


def local_path(path: str | Path) -> Path:
    """A local data folder named in params.yaml, as this stage can read it.

    A relative path is relative to the repo root. A queued or temp ``dvc exp run`` runs in a
    copy that holds only git- and DVC-tracked files, so an untracked folder such as
    ``data/raw/fmnist-unlabelled`` is missing there: then the main repo's (``DVC_ROOT``, which
    DVC sets for every stage) is read. What the manifests record stays the path as written, so
    the copy builds the same bytes.

    Args:
        path: ``data.unlabelled_root``, or ``data.root`` of an ``imagefolder`` source.

    Returns:
        ``path`` itself when it is absolute, exists, or DVC_ROOT is unset; else
        ``$DVC_ROOT/path``.
    """
    p = Path(path)
    root = os.environ.get("DVC_ROOT")
    if p.is_absolute() or p.exists() or not root:
        return p
    return Path(root) / p


class UnreadableImage(Exception):
    """One image that cannot be decoded or converted; :meth:`Source.iter` collects them."""


class BrokenImages(SourceError):
    """Image files of a source that do not decode or are in an unsupported mode, all named.

    Raised by :meth:`Source.iter` (pixels) and by the header scan of the folder sources
    (:func:`pipeline.data.sources.files.scan_headers`); ``build_all`` adds how to get the
    last shards back.
    """


@dataclass(frozen=True)
class SourceFile:
    """The encoded file an image was decoded from, for ``build_shards`` to keep its bytes.

    Attributes:
        format: PIL's format name of the file (``"JPEG"``, ``"PNG"``, ``"WEBP"``, ...).
        data: the file's bytes when decoding them with PIL
            (:func:`pipeline.data.external.open_image`: EXIF orientation applied) and
            converting to the split's mode (:func:`pipeline.data.modes.to_mode`) gives
            exactly the sample's image; ``None`` once the pixels were changed (converted from
            another mode, resized).
    """

    format: str
    data: bytes | None = None

    def changed(self) -> SourceFile:
        """The same format, without bytes: the pixels no longer equal the file's."""
        return SourceFile(self.format)


def keeps_pixels(file_mode: str, mode: str) -> bool:
    """Whether converting a decoded ``file_mode`` image to ``mode`` leaves its values as they are.

    ``L`` -> ``RGB`` copies the grey value into three channels (exact, and the loader's
    conversion does the same), so such a file's bytes still describe the sample.
    """
    return file_mode == mode or (file_mode, mode) == ("L", "RGB")


@dataclass(frozen=True)
class Sample:
    """One image of a split.

    Attributes:
        key: unique within the split; only ``[A-Za-z0-9_-]`` (safe as a WebDataset key).
        image: PIL image in the source's :attr:`Source.mode` (``"L"`` or ``"RGB"``).
        label: class index ``0..C-1``, or ``-1`` for an unlabelled image.
        file: the encoded file the image came from, or ``None`` (array datasets: Fashion-MNIST,
            CIFAR, STL-10); ``build_shards`` stores a JPEG's bytes as they are when
            ``file.data`` is set (``data.shard_format``, :mod:`pipeline.data.build`).
    """

    key: str
    image: Image.Image
    label: int
    file: SourceFile | None = None


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
        raise InputError(f"max_images must be >= 0, got {max_images}")
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
        build_settings: how the source turns files into images, recorded verbatim in each
            manifest's ``build`` settings (ImageFolder: the EXIF orientation rule); empty here.
    """

    name: str = ""
    class_names: tuple[str, ...] = ()
    mode: str = "L"
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    native_shape: tuple[int, int, int] | None = None
    build_settings: Mapping[str, object] = MappingProxyType({})

    def labels(self, split: str) -> np.ndarray:
        """Labels of a split, ``(N,)`` int64 (``-1`` = unlabelled), in source order."""
        raise NotImplementedError

    def _load(self, split: str, index: int) -> Sample:
        raise NotImplementedError

    def _check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise InputError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")

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
            BrokenImages: images that cannot be decoded or converted; raised after the last
                readable one, listing every bad path with its reason.
        """
        bad: list[str] = []
        for i in self.indices(split, max_images=max_images, seed=seed, shuffle=shuffle):
            try:
                yield self._load(split, int(i))
            except UnreadableImage as e:
                bad.append(str(e))
        if bad:
            raise BrokenImages(name_bad_files("unreadable image(s)", bad))


# --- array-backed sources --------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """A contiguous block of a split: ``images[i]`` -> HW or HWC uint8 via ``to_hwc``."""

    prefix: str  # key prefix: train / test / unlabeled
    images: np.ndarray
    labels: np.ndarray
    to_hwc: Callable[[np.ndarray], np.ndarray] | None = None


class ArraySource(Source):
    """A source whose splits concatenate :class:`Part` blocks (keys ``<prefix>_NNNNNN``)."""

    def __init__(self, parts: Mapping[str, Sequence[Part]]):
        """Index the parts of each split.

        Args:
            parts: ``{split: [Part, ...]}`` for every split in :data:`SPLITS`.
        """
        self._parts = {s: list(p) for s, p in parts.items()}
        self._labels = {s: np.concatenate([p.labels for p in ps]).astype(np.int64)
                        for s, ps in self._parts.items()}
        self._starts = {s: np.cumsum([0] + [len(p.labels) for p in ps]).tolist()
                        for s, ps in self._parts.items()}  # a list: bisect, per sample

    def labels(self, split: str) -> np.ndarray:
        """Labels of a split, ``(N,)`` int64 (``-1`` = unlabelled), in source order."""
        self._check_split(split)
        return self._labels[split]

    def _load(self, split: str, index: int) -> Sample:
        k = bisect.bisect_right(self._starts[split], index) - 1
        part, local = self._parts[split][k], index - self._starts[split][k]
        arr = part.images[local]
        if part.to_hwc is not None:
            arr = part.to_hwc(arr)
        # Image.fromarray's pixels (HW: L, HWC: RGB), without its checks (a third of the time)
        h, w = arr.shape[:2]
        image = Image.frombytes("L" if arr.ndim == 2 else "RGB", (w, h), arr.tobytes())
        return Sample(f"{part.prefix}_{local:06d}", image, int(part.labels[local]))


def find_dir(root: Path, subdirs: Sequence[str], names: Sequence[str]) -> Path | None:
    """The first ``root/sub`` (in ``subdirs`` order) holding every file in ``names``, or None."""
    for sub in subdirs:
        d = root / sub
        if all((d / n).is_file() for n in names):
            return d
    return None


def check_labels(labels: np.ndarray, num_classes: int, path: Path) -> None:
    """Raise :class:`SourceError` naming ``path`` unless every label is in ``0..num_classes-1``."""
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise SourceError(f"{path}: labels outside 0..{num_classes - 1}")
