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
the unlabelled samples. The keys and encoded images are copied into a temporary file as the
shards are read (:class:`_Spool`: memory holds ~40 bytes per sample, whatever the images'
size), and decoded when the split is written. Mode: ``L`` when every image is grey, else
``RGB`` (:mod:`pipeline.data.modes`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from array import array
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
from pipeline.data.sources.imagefolder import held_out, sanitize_key, split_positions

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
        self._spool = _Spool()
        labels = _Labels(spec)
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
                    labels.add(sample_label(record, label_field))
                except ValueError as e:
                    raise SourceError(f"{where}: {e}") from None
                self._spool.add(record["__key__"], image_member(record) or b"")
        self.class_names, self._labels = labels.done()
        if not (self._labels >= 0).any():
            raise SourceError(f"data.root = {spec!r}: no labelled sample (data.label_field "
                              f"{label_field!r}); data.source none pretrains without labels")
        split = split_positions(self._labels, len(self.class_names), test_fraction, seed)
        for name, part in split.items():
            if not len(part):
                raise SourceError(f"data.root = {spec!r}: data.test_fraction={test_fraction} "
                                  f"leaves the {name} split empty")
        unlabelled = np.flatnonzero(self._labels < 0)
        self._index = {"train": np.sort(split["train"]), "test": np.sort(split["test"]),
                       "pretrain": np.sort(np.concatenate([split["train"], unlabelled]))}
        log.info("webdataset %s: %d samples (%d labelled, %d unlabelled), %d classes, %d broken "
                 "skipped", spec, len(self._labels), len(self._labels) - len(unlabelled),
                 len(unlabelled), len(self.class_names),
                 index.num_broken or 0)

    def labels(self, split: str) -> np.ndarray:
        """Labels of a split, ``(N,)`` int64 (``-1`` = unlabelled), in shard order."""
        self._check_split(split)
        return self._labels[self._index[split]]

    def _load(self, split: str, index: int) -> Sample:
        i = int(self._index[split][index])
        key, data = self._spool.get(i)
        try:
            with open_image(data) as im:  # upright, as every reader decodes it
                image = to_mode(im, self.mode)
                # a JPEG's bytes describe the image whenever the mode conversion keeps its
                # values (its EXIF orientation is applied by every reader)
                kept = im.format == "JPEG" and keeps_pixels(im.mode, self.mode)
                file = SourceFile(str(im.format), data if kept else None)
        except ModeError as e:
            raise UnreadableImage(f"sample '{key}' ({e})") from None
        except Exception as e:  # noqa: BLE001 (the index decoded it: corrupt since)
            raise UnreadableImage(f"sample '{key}' ({type(e).__name__})") from None
        return Sample(f"{i:07d}_{sanitize_key(key + '.x')}", image,
                      int(self._labels[i]), file)


def _urls(spec: str) -> list[str] | None:
    """The shards ``spec`` names now, or None when it names none (index_shards says why)."""
    try:
        return expand_shards(spec, key="data.root")
    except (ValueError, RemoteError):
        return None


class _Spool:
    """The samples' keys and encoded images in an unnamed temporary file, read back by offset.

    Holds 12 bytes per sample in memory (an offset and a key length), so the build's memory does
    not grow with the images' bytes. The file is in the temporary directory
    (:func:`tempfile.gettempdir`: ``TMPDIR``), unlinked from its creation, so nothing is left
    behind, and its pages are the kernel's cache, not this process's memory.
    """

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="webdataset-source-")
        self._ends = array("q")  # end offset of sample i's bytes (key, then image)
        self._key_len = array("I")

    def add(self, key: str, image: bytes) -> None:
        """Append one sample's key and image bytes."""
        k = key.encode("utf-8")
        self._file.write(k)
        self._file.write(image)
        self._ends.append((self._ends[-1] if self._ends else 0) + len(k) + len(image))
        self._key_len.append(len(k))

    def get(self, i: int) -> tuple[str, bytes]:
        """Sample ``i``'s ``(key, image bytes)``."""
        self._file.flush()
        start = self._ends[i - 1] if i else 0
        data = os.pread(self._file.fileno(), self._ends[i] - start, start)
        k = self._key_len[i]
        return data[:k].decode("utf-8"), data[k:]


class _Labels:
    """The raw labels as they are read (int, str or None), kept as one int64 per sample.

    The index refused mixed kinds already (:func:`pipeline.data.index.check_labels`, naming the
    shards and keys); this is the build's second line.
    """

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.codes = array("q")  # an int label, or a string's code; -1 for none
        self.names: dict[str, int] = {}  # string label -> code, in order of first sight
        self.ints = False

    def add(self, label: int | str | None) -> None:
        if isinstance(label, str):
            self.codes.append(self.names.setdefault(label, len(self.names)))
        else:
            self.ints |= label is not None
            self.codes.append(-1 if label is None else label)
        if self.ints and self.names:
            raise SourceError(f"data.root = {self.spec!r}: labels are integers and strings "
                              "mixed")

    def done(self) -> tuple[tuple[str, ...], np.ndarray]:
        """Class names and the ``(N,)`` int64 labels (-1 = unlabelled).

        Integers ``0..C-1`` name classes ``"0".."C-1"``; strings name the classes they are,
        sorted, a label being the name's index.
        """
        codes = np.frombuffer(self.codes, dtype=np.int64).copy()
        if self.names:
            names = tuple(sorted(self.names))
            rank = np.empty(len(names) + 1, dtype=np.int64)
            pos = {n: i for i, n in enumerate(names)}
            rank[:-1] = [pos[n] for n in self.names]  # code -> sorted index
            rank[-1] = -1
            return names, rank[codes]  # code -1 picks rank[-1]
        top = int(codes.max(initial=-1))
        return tuple(str(c) for c in range(top + 1)), codes


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
