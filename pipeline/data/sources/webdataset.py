"""Existing WebDataset shards with labels as the labelled source (``data.source: webdataset``).

``data.root`` names the shards (a directory, glob or URL with braces:
:func:`pipeline.data.external.expand_shards`), in img2dataset's layout. A sample's label is its
``.cls`` member (``data.label_field: cls``) or a field of its ``.json`` member
(``data.label_field: <field>``): integers ``0..C-1`` (class names ``"0".."C-1"``), or strings
(class names sorted, label = the index); a sample without one (or with ``-1``) is unlabelled
and only joins pretraining. Undecodable samples are skipped up to ``data.max_broken_fraction``,
as in the index (:mod:`pipeline.data.index`), whose manifest of the set (``data/index/labelled``,
written by the ``index_shards`` stage) gives the shards, their sha256 and the broken keys when
it is there; otherwise the set is indexed in memory.

Splits: the labelled samples are split per class with a seeded shuffle into ``test``
(``round(n_c * data.test_fraction)`` per class) and ``train``; ``pretrain`` is ``train`` plus
the unlabelled samples. The encoded images are held in memory (this source is for the
evaluation data, which may be small; pretraining images belong in ``data.pretrain_shards``,
read in place), decoded when the split is written. Mode: ``L`` when every image is grey, else
``RGB`` (:mod:`pipeline.data.modes`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from pipeline.data.external import expand_shards, image_member, open_image, sample_label
from pipeline.data.index import entry_labels, index_shards
from pipeline.data.manifest import Manifest, ShardError
from pipeline.data.modes import ModeError, to_mode
from pipeline.data.remote import RemoteError
from pipeline.data.shards import iter_shard, sha256_file, shard_location
from pipeline.data.sources.base import (
    Sample,
    Source,
    SourceError,
    SourceFile,
    UnreadableImage,
    keeps_pixels,
)
from pipeline.data.sources.imagefolder import held_out, sanitize_key, split_per_class

log = logging.getLogger(__name__)


class WebDatasetSource(Source):
    """Labelled WebDataset shards (see the module docstring).

    Args:
        spec: ``data.root``.
        label_field: ``data.label_field``: ``cls`` or a ``.json`` field.
        test_fraction: held-out share per class, ``0 < x < 1``.
        seed: seeds that split.
        max_broken_fraction: ``data.max_broken_fraction``.
        index: the set's index manifest (``data/index/labelled``), or None to index here.

    Raises:
        SourceError: no shards, a shard unreadable, too many broken samples, a label that is not
            an integer or string, integer and string labels mixed, no labelled sample, or a
            split left empty.
        ShardError: a shard differing from the index given.
    """

    name = "webdataset"

    def __init__(self, spec: str, *, label_field: str = "cls", test_fraction: float = 0.2,
                 seed: int = 0, max_broken_fraction: float = 0.001,
                 index: Manifest | None = None):
        if index is None or [s.url for s in index.shards] != _urls(spec):
            try:
                index, _ = index_shards(spec, split="labelled", key="data.root",
                                        max_broken_fraction=max_broken_fraction,
                                        label_field=label_field)
            except ShardError as e:
                raise SourceError(str(e)) from None
        self.mode = index.mode
        self.native_shape = index.image_shape or None
        keys, images, raw_labels = [], [], []
        for entry in index.shards:
            where = shard_location(Path("."), entry)
            broken = {b.key for b in entry.broken or ()}
            expect = (entry.bytes, entry.sha256) if "://" in where else None
            if expect is None and sha256_file(where) != entry.sha256:
                raise ShardError(f"{where}: sha256 differs from the index (changed since "
                                 "`dvc repro` indexed it: run it again)")
            for record in iter_shard(where, expect=expect):
                if record["__key__"] in broken:
                    continue
                try:
                    label = sample_label(record, label_field)
                except ValueError as e:
                    raise SourceError(f"{where}: {e}") from None
                keys.append(record["__key__"])
                images.append(image_member(record))
                raw_labels.append(label)
        self.class_names, labels = _class_names(raw_labels, spec)
        self._keys, self._images = keys, images
        items = [(i, int(y)) for i, y in enumerate(labels) if y >= 0]
        if not items:
            raise SourceError(f"data.root = {spec!r}: no labelled sample (data.label_field "
                              f"{label_field!r}); data.source none pretrains without labels")
        split = split_per_class(items, len(self.class_names), test_fraction, seed)
        for name, part in split.items():
            if not part:
                raise SourceError(f"data.root = {spec!r}: data.test_fraction={test_fraction} "
                                  f"leaves the {name} split empty")
        unlabelled = [i for i, y in enumerate(labels) if y < 0]
        self._index = {"train": sorted(i for i, _ in split["train"]),
                       "test": sorted(i for i, _ in split["test"])}
        self._index["pretrain"] = sorted(self._index["train"] + unlabelled)
        self._labels = np.asarray(labels, dtype=np.int64)
        log.info("webdataset %s: %d samples (%d labelled, %d unlabelled), %d classes, %d broken "
                 "skipped", spec, len(keys), len(items), len(unlabelled), len(self.class_names),
                 index.num_broken or 0)

    def labels(self, split: str) -> np.ndarray:
        """Labels of a split, ``(N,)`` int64 (``-1`` = unlabelled), in shard order."""
        self._check_split(split)
        return self._labels[self._index[split]]

    def _load(self, split: str, index: int) -> Sample:
        i = self._index[split][index]
        try:
            with open_image(self._images[i]) as im:  # upright, as every reader decodes it
                image = to_mode(im, self.mode)
                # a JPEG's bytes describe the image whenever the mode conversion keeps its
                # values (its EXIF orientation is applied by every reader)
                kept = im.format == "JPEG" and keeps_pixels(im.mode, self.mode)
                file = SourceFile(str(im.format), self._images[i] if kept else None)
        except ModeError as e:
            raise UnreadableImage(f"sample '{self._keys[i]}' ({e})") from None
        except Exception as e:  # noqa: BLE001 (the index decoded it: corrupt since)
            raise UnreadableImage(f"sample '{self._keys[i]}' ({type(e).__name__})") from None
        return Sample(f"{i:07d}_{sanitize_key(self._keys[i] + '.x')}", image,
                      int(self._labels[i]), file)


def _urls(spec: str) -> list[str] | None:
    """The shards ``spec`` names now, or None when it names none (index_shards says why)."""
    try:
        return expand_shards(spec, key="data.root")
    except (ValueError, RemoteError):
        return None


def _class_names(raw: list[int | str | None], spec: str) -> tuple[tuple[str, ...], list[int]]:
    """Class names and integer labels (-1 = unlabelled) from the raw labels.

    The index refused mixed kinds already (:func:`pipeline.data.index.check_labels`, naming the
    shards and keys); this is the build's second line.
    """
    ints = [y for y in raw if isinstance(y, int)]
    strs = [y for y in raw if isinstance(y, str)]
    if ints and strs:
        raise SourceError(f"data.root = {spec!r}: labels are integers and strings mixed")
    if strs:
        names = tuple(sorted(set(strs)))
        pos = {n: i for i, n in enumerate(names)}
        return names, [pos[y] if isinstance(y, str) else -1 for y in raw]
    top = max(ints, default=-1)
    return tuple(str(c) for c in range(top + 1)), [y if isinstance(y, int) else -1 for y in raw]


def split_sizes(manifest: Manifest, test_fraction: float, spec: str) -> dict[str, int]:
    """The sizes of the splits the build makes from an indexed labelled set.

    Per class ``held_out(n, test_fraction)`` test samples
    (:func:`~pipeline.data.sources.imagefolder.split_per_class`), the rest train; ``pretrain``
    is ``train`` plus the unlabelled samples (:class:`WebDatasetSource`).

    Args:
        manifest: the index of ``data.root`` with label summaries (``index_shards`` with
            ``label_field``).
        test_fraction: ``data.test_fraction``.
        spec: ``data.root``, for messages.

    Returns:
        ``{"train", "test", "pretrain"}`` sample counts.

    Raises:
        SourceError: a split left empty (the build's message).
    """
    counts: dict[str, int] = {}
    unlabelled = 0
    for entry in manifest.shards:
        labels = entry_labels(entry)
        unlabelled += labels.unlabelled
        for name, n in labels.counts.items():
            counts[name] = counts.get(name, 0) + n
    test = sum(held_out(n, test_fraction) for n in counts.values())
    sizes = {"train": sum(counts.values()) - test, "test": test}
    for name, n in sizes.items():
        if not n:
            raise SourceError(f"data.root = {spec!r}: data.test_fraction={test_fraction} "
                              f"leaves the {name} split empty")
    return {**sizes, "pretrain": sizes["train"] + unlabelled}
