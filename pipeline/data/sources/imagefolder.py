"""ImageFolder: image files in class sub-folders, optionally under ``train/`` and ``test/``."""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data.modes import folder_mode
from pipeline.data.sources.base import (
    Sample,
    Source,
    SourceError,
)
from pipeline.data.sources.files import open_upright, scan_headers
from pipeline.errors import InputError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
# recorded in every manifest an ImageFolder builds (``build.exif_orientation``)
BUILD_SETTINGS = {"exif_orientation": "applied (PIL ImageOps.exif_transpose, before resize/crop)"}
_KEY_MAX_CHARS = 80  # USTAR member names are limited to 100 characters (key + extension)

Files = list[tuple[str, int]]  # (path, label) pairs

log = logging.getLogger(__name__)


def sanitize_key(relpath: str) -> str:
    """A WebDataset-safe key from a relative path: extension dropped, ``[^A-Za-z0-9_-]`` -> ``_``.

    Truncated to :data:`_KEY_MAX_CHARS` so tar member names stay under USTAR's 100 characters;
    callers prefix an index, which keeps keys unique.
    """
    stem = relpath.rsplit(".", 1)[0]
    return re.sub(r"[^A-Za-z0-9_-]+", "_", stem).strip("_")[:_KEY_MAX_CHARS]


class ImageFolderSource(Source):
    """Images in class sub-folders, optionally under ``train/`` and ``test/`` (or ``val/``).

    Layout: ``root/<class>/**/<image>`` (any nesting inside a class folder) is split into train
    and test per class with a seeded shuffle (``round(n_c * test_fraction)`` test images per
    class); ``root/train/<class>/...`` + ``root/test/<class>/...`` (``val`` accepted for
    ``test``) is used as given. Files with extensions .jpg .jpeg .png .webp .bmp .tif .tiff (any
    case) are images (a multi-page TIFF contributes its first page); hidden files and folders
    are ignored. Order is sorted by relative path. Symlinked folders are followed anywhere in
    the tree, each real directory once (see :func:`_scan_trees`).

    Orientation: each image is turned upright as its EXIF ``Orientation`` tag says (PIL's
    ``ImageOps.exif_transpose``: a phone photo with Orientation 6 is shown rotated 90 degrees
    clockwise from its raw pixel layout, as every viewer shows it), before the mode conversion
    and before any resize or crop; sizes and :attr:`native_shape` are the upright ones. A JPEG
    stored whole keeps its bytes and tag, and is turned by every reader when decoded
    (:func:`pipeline.data.external.open_image`).

    Modes (:mod:`pipeline.data.modes` has the full table): the dataset mode is ``"L"``
    when every image is grey (1, L, LA, 16-bit, I, F, grey palettes) and ``"RGB"`` as soon as
    one image is colour, grey images then getting three equal channels. High bit-depth images
    are scaled to 8 bits (16-bit 32768 -> 128), transparency is composited onto white, and an
    unsupported mode (found when the headers are scanned) or an ``I``/``F`` value outside its
    fixed range (found when the image is read) is refused with a line naming the file.

    Keys: ``<7-digit index>_<relative path without extension, non [A-Za-z0-9_-] -> '_'>``,
    truncated so tar member names stay under USTAR's 100 characters; unique by the index.

    There are no published normalisation statistics: :attr:`mean`/:attr:`std` are ``None`` and
    ``build_all`` records the pixel statistics of the pretrain split instead.
    """

    name = "imagefolder"
    build_settings = BUILD_SETTINGS

    def __init__(self, root: str | Path, *, test_fraction: float = 0.2, seed: int = 0,
                 exclude: Collection[str] = ()):
        """Scan the folders and every image header.

        Args:
            root: the dataset directory (required).
            exclude: image paths relative to ``root`` left out before the split: the broken
                files that ``index_shards`` listed within ``data.max_broken_fraction``
                (:func:`pipeline.data.folder_index.broken_in_folder`).
            test_fraction: share of each class held out as test when there is no train/test
                split on disk; ``0 < x < 1``.
            seed: seeds that held-out split.

        Raises:
            SourceError: no root, a layout :func:`scan_folder` or :func:`split_files`
                refuses (an empty class folder, one whose every image is in ``exclude``, ...),
                or images whose header cannot be read (all bad paths listed).
            ValueError: ``test_fraction`` not in (0, 1).
        """
        if not str(root):
            raise SourceError("imagefolder: data.root must name the image directory")
        self.root = Path(root)
        if not self.root.is_dir():
            raise SourceError(f"{self.root}: not a directory")
        classes, files, self.broken = split_files(scan_folder(self.root), test_fraction, seed,
                                                  exclude)
        files["pretrain"] = files["train"]
        self.class_names = tuple(classes)
        self._files = {s: sorted(f) for s, f in files.items()}
        self._scan_headers()

    def _scan_headers(self) -> None:
        """Decide :attr:`mode` and :attr:`native_shape` from every image header.

        Raises:
            SourceError: unreadable headers or unsupported modes (:func:`scan_headers`).
        """
        kinds, sizes = scan_headers(sorted({path for path, _ in self._files["train"]}
                                           | {path for path, _ in self._files["test"]}))
        self.mode = folder_mode(kinds)
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
        image, file = open_upright(path, self.mode)
        rel = os.path.relpath(path, self.root)
        return Sample(f"{index:07d}_{sanitize_key(rel)}", image, label, file)


SPLIT_NAMES = ("train", "training", "test", "testing", "val", "valid", "validation")


@dataclass
class FolderScan:
    """The class folders of an ImageFolder root and their image files; no image read.

    Attributes:
        root: the dataset directory.
        trees: ``[root]``, or ``[root/train, root/test]`` (``val`` for ``test``).
        classes: each tree's class names, sorted.
        files: each tree's ``(path, label)`` image files, the label indexing that tree's
            classes, in walk order (:func:`_scan_trees`).
        skipped: entries the walk skipped, per reason (:data:`SKIP_REASONS`).
    """

    root: Path
    trees: list[Path]
    classes: list[list[str]]
    files: list[Files]
    skipped: Counter[str]

    @property
    def paths(self) -> list[str]:
        """Every image file the build reads, sorted by its path relative to :attr:`root`."""
        return sorted((path for files in self.files for path, _ in files),
                      key=lambda path: os.path.relpath(path, self.root))


def scan_folder(root: Path) -> FolderScan:
    """Walk an ImageFolder root: its layout, class folders and image files (headers not read).

    ``root/train/<class>`` with ``root/test/<class>`` (or ``val``; lower case) is a split on
    disk; otherwise ``root/<class>``. ``index_shards`` and the build both call it, so they
    name the same files (a folder reached through two symlinks gets one name) and refuse the
    same layouts, ``index_shards`` while the shards are still there. One class folder (in
    ``train/`` for a split on disk), and class folders named like a split (``Train``,
    ``validation``, ...) outside that layout, are logged as a warning.

    Raises:
        SourceError: no class sub-folders, a folder that is a dangling symlink (a class, or
            ``train``/``test``/``val``), or a class folder that holds no image.
    """
    _refuse_dangling_folders(root)
    subdirs = {d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")}
    held_out = "test" if "test" in subdirs else "val" if "val" in subdirs else None
    trees = [root / "train", root / held_out] if "train" in subdirs and held_out else [root]
    walk = ImageWalk()
    scanned = _scan_trees(trees, walk)
    if len(scanned[0][0]) == 1:  # a test tree may hold fewer classes than train
        log.warning("%s: one class folder (%s): every kNN and linear-probe prediction is right "
                    "by construction; images without classes go in data.unlabelled_root, and a "
                    "split on disk is train/ beside test/ or val/ (lower case)", trees[0],
                    scanned[0][0][0])
    named_like_splits = [c for c in scanned[0][0] if c.lower() in SPLIT_NAMES]
    if len(trees) == 1 and named_like_splits:
        log.warning("%s: class folder(s) named like a split: %s; a split on disk is train/ "
                    "beside test/ or val/ (lower case), else every sub-folder is a class",
                    root, ", ".join(named_like_splits))
    return FolderScan(root, trees, [c for c, _ in scanned], [f for _, f in scanned],
                      walk.skipped)


def split_files(scan: FolderScan, test_fraction: float, seed: int,
                exclude: Collection[str] = ()) -> tuple[list[str], dict[str, Files], int]:
    """Class names and the ``train``/``test`` files of a :class:`FolderScan`.

    Files in ``exclude`` (relative to the root) are left out first. A split on disk is used as
    given; a bare ``root/<class>`` is split per class (:func:`split_per_class`).

    Args:
        scan: :func:`scan_folder` of the root.
        test_fraction: share of each class held out as test without a split on disk;
            ``0 < x < 1``.
        seed: seeds that held-out split.
        exclude: the broken files ``index_shards`` listed (:func:`is_excluded`).

    Returns:
        ``(class names, {"train": files, "test": files}, files left out)``; files are
        ``(path, label)`` pairs.

    Raises:
        ValueError: ``test_fraction`` not in (0, 1).
        SourceError: a class folder whose every image is in ``exclude``, a test class unknown
            to train, a class that ``test_fraction`` leaves without a train image, or a test
            split left empty.
    """
    if not 0 < test_fraction < 1:
        raise InputError(f"test_fraction must be in (0, 1), got {test_fraction}")
    kept, n_left_out = [], 0
    for tree, classes, files in zip(scan.trees, scan.classes, scan.files):
        good = [(path, y) for path, y in files if not is_excluded(path, scan.root, exclude)]
        n_left_out += len(files) - len(good)
        all_broken = sorted(set(range(len(classes))) - {y for _, y in good})
        if all_broken:
            raise SourceError(
                "class folder(s) whose every image is broken (logged above; "
                "data.max_broken_fraction lets them through, but a class needs an image): "
                + ", ".join(str(tree / classes[y]) for y in all_broken))
        kept.append((classes, good))
    if len(kept) == 2:
        (classes, train), (test_classes, test) = kept
        unknown = sorted(set(test_classes) - set(classes))
        if unknown:
            raise SourceError(f"{scan.trees[1]}: classes {unknown} are not in {scan.trees[0]}")
        remap = [classes.index(c) for c in test_classes]
        return classes, {"train": train, "test": [(p, remap[y]) for p, y in test]}, n_left_out
    ((classes, items),) = kept
    files = split_per_class(items, len(classes), test_fraction, seed)
    counts = Counter(y for _, y in items)
    no_train = sorted(set(range(len(classes))) - {y for _, y in files["train"]})
    rule = f"a class of n images holds out int(n x {test_fraction:g} + 0.5) for test"
    if no_train:
        left = " left" if n_left_out else ""  # some of the images were broken
        raise SourceError(
            f"data.test_fraction = {test_fraction} holds out every image of class folder(s) "
            + ", ".join(f"{scan.root / classes[y]} ({counts[y]} image(s){left})"
                        for y in no_train)
            + f" ({rule}); add images or lower data.test_fraction")
    if not files["test"]:
        raise SourceError(f"data.test_fraction = {test_fraction} leaves the test split of "
                          f"{scan.root} empty ({rule}); raise it or add images")
    return classes, files, n_left_out


def is_excluded(path: str, root: str | Path, exclude: Collection[str]) -> bool:
    """Whether ``path`` is one of ``exclude``, paths relative to ``root``.

    ``exclude`` is a folder index's ``broken`` list (:func:`pipeline.data.folder_index.
    broken_in_folder`), left out by :class:`ImageFolderSource` and the unlabelled tree alike.
    """
    return os.path.relpath(path, root) in exclude


def _refuse_dangling_folders(directory: Path) -> None:
    """Stop on a symlink to nothing in ``directory`` that would be a folder (a disk not mounted).

    Hidden entries and names with an image extension (files, which are not read at this
    level) are left alone.

    Raises:
        SourceError: naming every such link.
    """
    dangling = sorted(str(d) for d in directory.iterdir()
                      if d.is_symlink() and not d.exists() and not d.name.startswith(".")
                      and not d.name.lower().endswith(IMAGE_EXTENSIONS))
    if dangling:
        raise SourceError(f"{directory}: symlink(s) to nothing, so folder(s) missing (a disk "
                          f"not mounted?): {', '.join(dangling)}; mount it or remove the link")


def _scan_trees(directories: list[Path], walk: ImageWalk) -> list[tuple[list[str], Files]]:
    """Class names and ``(path, label)`` image files of each tree, symlinks followed once.

    A tree is ``directory/<class>/**/<image>``. Symlinked directories are followed anywhere (a
    class folder or any folder below it), and each real directory (``(st_dev, st_ino)``) is
    visited once, so a symlink loop ends and no image is counted twice:

    1. every directory reachable WITHOUT following a symlink, in all ``directories`` (so an
       image reached both directly and through a symlink counts where it really is, and a
       symlink in ``train/`` into ``test/`` adds nothing to train);
    2. then the symlinks, in the order found (trees, classes and names sorted): each opens a
       directory not seen yet, walked the same way, its own symlinks joining the end of the list.

    Paths keep the symlink's name (``cls/link/x.jpg``), so keys and order are deterministic.

    Raises:
        SourceError: a tree without class sub-folders, a class folder that is a dangling
            symlink, or a class folder without images (a class folder that is a symlink to a
            directory counted elsewhere is named as such).
    """
    trees = []
    for directory in directories:
        _refuse_dangling_folders(directory)
        classes = sorted(d.name for d in directory.iterdir()
                         if d.is_dir() and not d.name.startswith("."))
        if not classes:
            raise SourceError(f"{directory}: no class sub-folders")
        found: list[list[str]] = [[] for _ in classes]
        for label, cls in enumerate(classes):
            walk.enter(directory / cls, found[label])
        trees.append((directory, classes, found))
    walk.follow_links()
    out = []
    for directory, classes, found in trees:
        empty = [str(directory / c) + (" (a symlink to a directory counted elsewhere)"
                                       if (directory / c).is_symlink() else "")
                 for c, f in zip(classes, found) if not f]
        if empty:
            raise SourceError(f"class folder(s) without images ({', '.join(IMAGE_EXTENSIONS)}): "
                              + ", ".join(empty))
        out.append((classes, [(p, label) for label, f in enumerate(found) for p in sorted(f)]))
    return out


def skip_reason(name: str) -> str | None:
    """Why a file is not an image of a tree (:data:`SKIP_REASONS`), or None for an image."""
    if name.startswith("._"):
        return "appledouble"
    if name.startswith("."):
        return "hidden"
    if not name.lower().endswith(IMAGE_EXTENSIONS):
        return "not_image"
    return None


SKIP_REASONS = ("appledouble", "hidden", "not_image")  # what a walk skips, by reason


class ImageWalk:
    """Directory walks that share one set of visited real directories (see :func:`_scan_trees`).

    Symlinked directories are followed, each real directory once (loop-safe). Hidden folders
    and files, AppleDouble ``._*`` files and non-images are skipped, and counted per reason in
    :attr:`skipped` (a hidden folder counts once and is not entered).
    """

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] = set()
        self.links: list[tuple[str, list[str]]] = []  # (symlink path, its class's file list)
        self.skipped: Counter[str] = Counter()

    def _first_visit(self, path: str) -> bool:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def enter(self, top: Path | str, files: list[str]) -> None:
        """Walk ``top`` without following symlinks (a symlinked ``top`` waits for its turn)."""
        if os.path.islink(top):
            self.links.append((str(top), files))
        elif self._first_visit(str(top)):
            self._walk(str(top), files)

    def _walk(self, top: str, files: list[str]) -> None:
        for dirpath, dirnames, filenames in os.walk(top):
            keep = []
            self.skipped["hidden"] += sum(d.startswith(".") for d in dirnames)
            for d in sorted(d for d in dirnames if not d.startswith(".")):
                path = os.path.join(dirpath, d)
                if os.path.islink(path):
                    self.links.append((path, files))
                elif self._first_visit(path):
                    keep.append(d)
            dirnames[:] = keep
            for f in filenames:
                why = skip_reason(f)
                if why is None:
                    files.append(os.path.join(dirpath, f))
                else:
                    self.skipped[why] += 1

    def follow_links(self) -> None:
        """Open every pending symlink to a directory not seen yet (new ones join the list)."""
        i = 0
        while i < len(self.links):
            path, files = self.links[i]
            i += 1
            if os.path.isdir(path) and self._first_visit(path):
                self._walk(path, files)


def split_per_class(items: Files, num_classes: int, test_fraction: float,
                    seed: int) -> dict[str, Files]:
    """A seeded per-class train/test split: ``round(n_c * test_fraction)`` test files per class.

    Args:
        items: ``(path, label)`` pairs.
        num_classes: C.
        test_fraction: share of each class held out as test.
        seed: the split's seed.

    Returns:
        ``{"train": files, "test": files}`` (:func:`split_positions` of the sorted pairs).
    """
    items = sorted(items)
    labels = np.fromiter((y for _, y in items), dtype=np.int64, count=len(items))
    return {name: [items[i] for i in pos]
            for name, pos in split_positions(labels, num_classes, test_fraction, seed).items()}


def split_positions(labels: np.ndarray, num_classes: int, test_fraction: float,
                    seed: int) -> dict[str, np.ndarray]:
    """The seeded per-class split of positions ``0..N-1`` by their labels (-1: in neither).

    Class by class (0 to C-1), a permutation of the class's positions (ascending) from one
    generator seeded ``[seed, 2]``; its first :func:`held_out` are test, the rest train.

    Args:
        labels: ``(N,)`` int labels, ``-1..C-1``.
        num_classes: C.
        test_fraction: share of each class held out as test.
        seed: the split's seed.

    Returns:
        ``{"train": (N_train,), "test": (N_test,)}`` int64 positions, class by class.
    """
    rng = np.random.default_rng([seed, 2])
    out: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    for c in range(num_classes):
        members = np.flatnonzero(labels == c)
        n_test = held_out(len(members), test_fraction)
        perm = rng.permutation(len(members))
        out["test"].append(members[perm[:n_test]])
        out["train"].append(members[perm[n_test:]])
    return {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in out.items()}


def held_out(n: int, test_fraction: float) -> int:
    """Test images of a class of ``n``: ``int(n * test_fraction + 0.5)`` (:func:`split_per_class`).

    The index counts the splits with it before the build makes them (a class of 10 at 0.25
    holds out 3).
    """
    return int(n * test_fraction + 0.5)
