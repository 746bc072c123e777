"""Images without labels: an image tree with no class structure, mixed into the pretrain split.

``data.unlabelled_root`` names a directory of images in any nesting (no class folders), of any
sizes and PIL modes. Its images join the ``pretrain`` split with label ``-1`` (the STL-10
convention that every evaluation entry point honours), alone or together with the labelled
source's own pretrain split (``data.pretrain_labelled``); the labelled source still gives the
``train`` and ``test`` splits, and may be small. ``data.source: none`` is a labelled source with
no images at all: pretraining only.

Files (:func:`walk_images`): extensions and keys as :mod:`pipeline.data.sources.imagefolder`
(``.jpg .jpeg .png .webp .bmp .tif .tiff``, any case); skipped and counted by reason, in the
log and in the folder index ``data/index/folders.json``: AppleDouble files (``._*``, macOS
resource forks), other hidden files and folders (``.*``; a hidden folder counts once, its
content is not read), and files without an image extension (``README.txt``, ``*.json``, ...).
The ``index_shards`` stage has decoded every image before the build
(:func:`pipeline.data.folder_index.index_folders`) and listed the broken ones it let through
(``data.max_broken_fraction``); the build leaves those out (``exclude``). Every other image
header is read when the tree is opened (:func:`pipeline.data.sources.files.scan_headers`);
a file with an image extension whose header does not decode stops with one line naming every
such file, and so does one whose pixels fail later (:meth:`pipeline.data.sources.base.Source.iter`:
a file changed between the two stages).

Modes (:mod:`pipeline.data.modes`): the tree and the labelled source end up in ONE mode,
by the folder rule: ``L`` when every image of both is grey, else ``RGB`` (grey images then get
three equal channels, no information lost or invented), so pretraining and evaluation images
have the same channels. Sizes: with ``data.image_size`` 0 and no ``data.max_side`` the images
are stored as they are, so they must all be one square size (that of the labelled source);
otherwise the build refuses before writing anything.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Collection, Mapping
from pathlib import Path

import numpy as np

from pipeline.data.modes import folder_mode, to_mode
from pipeline.data.sources.base import Sample, Source, SourceError, keeps_pixels, local_path
from pipeline.data.sources.files import open_upright, scan_headers
from pipeline.data.sources.imagefolder import (
    BUILD_SETTINGS,
    IMAGE_EXTENSIONS,
    SKIP_REASONS,
    ImageWalk,
    is_excluded,
    sanitize_key,
)

log = logging.getLogger(__name__)

KEY_PREFIX = "u"  # keys of unlabelled images: u<7-digit index>_<relative path>


def walk_images(root: Path) -> tuple[list[str], Counter[str]]:
    """Every image file under ``root`` (any nesting, symlinked folders once), sorted by path.

    The walk of an imagefolder class folder (:class:`~pipeline.data.sources.imagefolder.
    ImageWalk`): symlinked directories followed, each real directory once.

    Args:
        root: the tree's top directory.

    Returns:
        ``(paths, skipped)``: the image paths (``root``-joined strings) and the count of
        skipped entries per reason (``appledouble``, ``hidden``, ``not_image``); a hidden folder
        counts once as ``hidden`` and is not entered.
    """
    walk = ImageWalk()
    found: list[str] = []
    walk.enter(root, found)
    walk.follow_links()
    found.sort(key=lambda p: os.path.relpath(p, root))
    return found, walk.skipped


def describe_skipped(skipped: Mapping[str, int]) -> str:
    """Counts per reason of :func:`walk_images` as ``"2 appledouble, 1 hidden, 3 not_image"``.

    ``"none"`` when nothing was skipped.
    """
    parts = [f"{skipped[r]} {r}" for r in SKIP_REASONS if skipped.get(r)]
    return ", ".join(parts) or "none"


class UnlabelledTree:
    """The images of ``data.unlabelled_root``, headers read once.

    Attributes:
        root: the directory.
        paths: image files in sorted relative-path order, the excluded ones left out.
        broken: how many were excluded.
        skipped: skipped entries per reason (:func:`walk_images`).
        kinds: ``{"L"}``, ``{"RGB"}`` or both (:func:`pipeline.data.modes.image_kind`).
        sizes: the distinct ``(W, H)`` of the images.
    """

    def __init__(self, root: str | Path, *, exclude: Collection[str] = ()):
        """Walk the tree and read every image header.

        Args:
            root: the directory (``data.unlabelled_root`` as written).
            exclude: paths relative to ``root`` left out: the broken files that
                ``index_shards`` listed within ``data.max_broken_fraction``
                (:func:`pipeline.data.folder_index.broken_in_folder`).

        Raises:
            SourceError: ``root`` is not a directory, holds no image, or holds images whose
                header cannot be read or whose mode is unsupported (all named, one line).
        """
        self.root = Path(root)  # as written: the manifest records it
        self.top = local_path(root)  # where it is read (the main repo's in an exp copy)
        if not self.top.is_dir():
            raise SourceError(f"data.unlabelled_root = {str(root)!r}: not a directory")
        self.paths, self.skipped = walk_images(self.top)
        self.broken = len(self.paths)
        self.paths = [p for p in self.paths if not is_excluded(p, self.top, exclude)]
        self.broken -= len(self.paths)
        if not self.paths:
            raise SourceError(f"{self.root}: no images ({', '.join(IMAGE_EXTENSIONS)}) in the "
                              f"unlabelled tree (skipped: {self.describe_skipped()})")
        self.kinds, self.sizes = scan_headers(self.paths)

    def __len__(self) -> int:
        return len(self.paths)

    def describe_skipped(self) -> str:
        """``"2 appledouble, 1 hidden, 3 not_image"`` (``"none"`` when nothing was skipped)."""
        return describe_skipped(self.skipped)

    def build_record(self) -> dict[str, object]:
        """What the pretrain manifest records under ``build.unlabelled``.

        Not the skipped files, nor the broken ones left out: a README added beside the images,
        or a broken download, would then change the manifest, a dep of ``pretrain``, and
        retrain on the same shards. They are counted in the log and in
        ``data/index/folders.json`` (:func:`pipeline.data.folder_index.index_folders`).
        """
        return {"root": str(self.root), "images": len(self.paths), **BUILD_SETTINGS}

    def load(self, index: int, mode: str) -> Sample:
        """Image ``index`` in ``mode``, label -1.

        Raises:
            UnreadableImage: the pixels cannot be decoded or converted (names the file).
        """
        path = self.paths[index]
        image, file = open_upright(path, mode)
        rel = os.path.relpath(path, self.top)
        return Sample(f"{KEY_PREFIX}{index:07d}_{sanitize_key(rel)}", image, -1, file)


class NoLabelsSource(Source):
    """``data.source: none``: no labelled images (every split empty); pretraining only."""

    name = "none"
    class_names: tuple[str, ...] = ()
    mode = "L"

    def labels(self, split: str) -> np.ndarray:
        """An empty ``(0,)`` int64 array for every split."""
        self._check_split(split)
        return np.zeros(0, dtype=np.int64)


class PretrainMix(Source):
    """A labelled source whose ``pretrain`` split also holds an unlabelled tree (label -1).

    ``train`` and ``test`` are the labelled source's; ``pretrain`` is its pretrain split (when
    ``include_labelled``) followed by the tree's images. Every image is in :attr:`mode`, the
    folder rule over both (see the module docstring).

    Args:
        labelled: the labelled source (any :class:`Source`, or :class:`NoLabelsSource`).
        tree: the unlabelled images, or None.
        include_labelled: whether the labelled source's pretrain split joins pretraining
            (``data.pretrain_labelled``).
        resized: the build resizes or caps every image (``data.image_size`` or
            ``data.max_side`` > 0), so the images may have any size.

    Raises:
        SourceError: the pretraining images are stored as they are (``resized`` false) but are
            not all one square size.
    """

    def __init__(self, labelled: Source, tree: UnlabelledTree | None, *,
                 include_labelled: bool, resized: bool):
        self.labelled, self.tree, self.include = labelled, tree, include_labelled
        self.name = labelled.name
        self.class_names = labelled.class_names
        self.build_settings = labelled.build_settings
        kinds = set(tree.kinds) if tree else set()
        if include_labelled or labelled.count("train") or labelled.count("test"):
            kinds.add(labelled.mode)
        self.mode = folder_mode(kinds) if kinds else labelled.mode
        same = self.mode == labelled.mode  # published statistics hold for their own channels
        self.mean = labelled.mean if same else None
        self.std = labelled.std if same else None
        self.native_shape = labelled.native_shape
        self._n_labelled = labelled.count("pretrain") if include_labelled else 0
        if tree is not None and not resized:
            self._check_sizes()

    def _check_sizes(self) -> None:
        assert self.tree is not None
        sizes = set(self.tree.sizes)
        if self._n_labelled:
            if self.labelled.native_shape is None:
                return  # a labelled imagefolder of mixed sizes: the pretrain stage names it
            _, h, w = self.labelled.native_shape
            sizes.add((w, h))
        (w, h), *rest = sorted(sizes)
        if rest or w != h:
            shown = ", ".join(f"{a}x{b}" for a, b in sorted(sizes)[:4])
            more = f" and {len(sizes) - 4} more" if len(sizes) > 4 else ""
            raise SourceError(f"{self.tree.root}: the pretraining images are {shown}{more} px "
                              "and data.image_size is 0 (images stored as they are must be one "
                              "square size): set data.image_size to resize them, or "
                              "data.max_side to keep them whole")

    def labels(self, split: str) -> np.ndarray:
        """Labels of a split, ``(N,)`` int64; the tree's images are ``-1`` in ``pretrain``."""
        self._check_split(split)
        if split != "pretrain":
            return self.labelled.labels(split)
        own = self.labelled.labels("pretrain") if self.include else np.zeros(0, np.int64)
        return np.concatenate([own, np.full(len(self.tree or ()), -1, dtype=np.int64)])

    def _load(self, split: str, index: int) -> Sample:
        if split == "pretrain" and index >= self._n_labelled:
            assert self.tree is not None
            return self.tree.load(index - self._n_labelled, self.mode)
        s = self.labelled._load(split, index)
        if s.image.mode == self.mode:
            return s
        # the folder rule only ever turns L into RGB here, which keeps the pixels (keeps_pixels)
        file = s.file if s.file is None or keeps_pixels(s.image.mode, self.mode) else (
            s.file.changed())
        return Sample(s.key, to_mode(s.image, self.mode), s.label, file)
