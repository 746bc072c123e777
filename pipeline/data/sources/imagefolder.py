"""ImageFolder: image files in class sub-folders, optionally under ``train/`` and ``test/``."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.data.sources.base import Sample, Source, SourceError, UnreadableImage
from pipeline.data.sources.modes import SUPPORTED_MODES, ModeError, folder_mode, image_kind, to_mode

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
_KEY_MAX_CHARS = 80  # USTAR member names are limited to 100 characters (key + extension)

Files = list[tuple[str, int]]  # (path, label) pairs


def _sanitize_key(relpath: str) -> str:
    stem = relpath.rsplit(".", 1)[0]
    return re.sub(r"[^A-Za-z0-9_-]+", "_", stem).strip("_")[:_KEY_MAX_CHARS]


class ImageFolderSource(Source):
    """Images in class sub-folders, optionally under ``train/`` and ``test/`` (or ``val/``).

    Layout: ``root/<class>/**/<image>`` (any nesting inside a class folder) is split into train
    and test per class with a seeded shuffle (``round(n_c * test_fraction)`` test images per
    class); ``root/train/<class>/...`` + ``root/test/<class>/...`` (``val`` accepted for
    ``test``) is used as given. Files with extensions .jpg .jpeg .png .webp .bmp .tif .tiff (any
    case) are images (a multi-page TIFF contributes its first page); hidden files and folders
    are ignored. Order is sorted by relative path.

    Modes (:mod:`pipeline.data.sources.modes` has the full table): the dataset mode is ``"L"``
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
        classes, files = self._discover(test_fraction, seed)
        files["pretrain"] = files["train"]
        self.class_names = tuple(classes)
        self._files = {s: sorted(f) for s, f in files.items()}
        self._scan_headers()

    def _discover(self, test_fraction: float, seed: int) -> tuple[list[str], dict[str, Files]]:
        """Class names and the ``train``/``test`` files: as on disk, or a seeded per-class split."""
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
            return classes, {"train": train, "test": [(p, remap[y]) for p, y in test]}
        classes, items = _scan_classes(self.root)
        files = _split_per_class(items, len(classes), test_fraction, seed)
        for split, f in files.items():
            if not f:
                raise SourceError(f"{self.root}: test_fraction={test_fraction} leaves the "
                                  f"{split} split empty")
        return classes, files

    def _scan_headers(self) -> None:
        """Decide :attr:`mode` and :attr:`native_shape` from every image header.

        Palette images are decoded here (their used colours decide grey or colour).

        Raises:
            SourceError: unreadable headers or unsupported modes, every bad file listed.
        """
        kinds: set[str] = set()
        sizes: set[tuple[int, int]] = set()
        bad, unsupported = [], []
        for path, _ in sorted(set(self._files["train"]) | set(self._files["test"])):
            try:
                with Image.open(path) as im:
                    kinds.add(image_kind(im))
                    sizes.add(im.size)
            except ModeError as e:
                unsupported.append(f"{path} ({e})")
            except Exception as e:  # PIL raises several types for unreadable files
                bad.append(f"{path} ({type(e).__name__})")
        if bad:
            raise SourceError(f"{len(bad)} unreadable image(s): " + "; ".join(bad))
        if unsupported:
            raise SourceError(f"{len(unsupported)} image(s) in an unsupported mode: "
                              + "; ".join(unsupported)
                              + f" (supported PIL modes: {', '.join(SUPPORTED_MODES)})")
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
        try:
            with Image.open(path) as im:
                im.load()
                image = to_mode(im, self.mode)
        except ModeError as e:  # e.g. float values outside 0..1
            raise UnreadableImage(f"{path} ({e})") from None
        except Exception as e:  # truncated / corrupt data past the header
            raise UnreadableImage(f"{path} ({type(e).__name__}: {e})") from None
        rel = os.path.relpath(path, self.root)
        return Sample(f"{index:07d}_{_sanitize_key(rel)}", image, label)


def _scan_classes(directory: Path) -> tuple[list[str], Files]:
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


def _split_per_class(items: Files, num_classes: int, test_fraction: float,
                     seed: int) -> dict[str, Files]:
    rng = np.random.default_rng([seed, 2])
    by_class: list[Files] = [[] for _ in range(num_classes)]
    for item in items:
        by_class[item[1]].append(item)
    out: dict[str, Files] = {"train": [], "test": []}
    for members in by_class:
        members.sort()
        n_test = int(len(members) * test_fraction + 0.5)
        perm = rng.permutation(len(members))
        out["test"] += [members[i] for i in perm[:n_test]]
        out["train"] += [members[i] for i in perm[n_test:]]
    return out
