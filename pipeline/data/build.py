"""Writing deterministic WebDataset shards and their manifests (the ``build_shards`` stage).

Tar headers carry a constant mtime, owner and mode, PNGs and JPEGs are encoded with fixed
options and no metadata, and kept JPEGs are the files' own bytes, so rebuilding from the same
source, caps and seed gives byte-identical shards (and DVC sees no change downstream). The
format itself (members, manifest fields) is :mod:`pipeline.data.shards`.

The tars hold the bytes the standard library's ``tarfile`` writes as webdataset's
``ShardWriter``/``TarWriter`` (1.0.2) does (a ``w|`` stream, members of a sample in sorted
extension order, same headers: the golden manifests' sha256 pin the bytes), built member by
member on ``data.build_workers`` processes (:mod:`pipeline.data.encode_pool`) and written here
in order, so the bytes do not depend on the count. The build
imports neither webdataset nor torchvision: importing torch alone takes ~500 MiB resident, more
than a 60 MP photo's decoded pixels (``benchmarks/big_photo.py``).

How each image is stored (``data.shard_format``: ``auto``, ``png``, ``jpeg``) is
:mod:`pipeline.data.encode`; a split that holds a JPEG member records the choice in its
manifest (``build.shard_format``, ``build.jpeg_quality`` and ``build.members``).

Outputs are built in a temporary sibling directory and swapped in with ``os.replace``, so a
failure leaves the previous outputs untouched.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from pipeline.cores import resolve_workers
from pipeline.data.encode import JPEG_QUALITY, MEMBER_KINDS, limit_short_side, resize_samples
from pipeline.data.encode_pool import Encoded, EncodePool, tar_end
from pipeline.data.manifest import (
    CHANNELS,
    Manifest,
    ShardEntry,
    ShardError,
    pixel_stats,
    round6,
    write_manifest,
)
from pipeline.data.remote import ShardURL, shards_location
from pipeline.data.shards import KEY_RE, SHARD_PATTERN, sample_key_at, sha256_file
from pipeline.data.sources import (
    SPLITS,
    BrokenImages,
    PretrainMix,
    Sample,
    Source,
    SourceError,
    UnlabelledTree,
    open_source,
)
from pipeline.errors import InputError

if TYPE_CHECKING:
    from pipeline.config import DataParams

log = logging.getLogger(__name__)

def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Swap a finished temp directory in for ``out_dir`` (two renames on one filesystem)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ShardError(f"{out_dir}: exists and is not a directory")
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
        os.replace(out_dir, old)  # renaming onto an empty directory is allowed
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)


class _Progress:
    """A tqdm bar (tqdm shows it on a terminal only), else a log line per finished shard."""

    def __init__(self, split: str, total: int | None, enabled: bool):
        self.split, self.total, self.enabled = split, total, enabled
        self.bar = tqdm(total=total, desc=f"shards {split}", unit="img",
                        disable=None if enabled else True)
        self.start = time.monotonic()

    def update(self, n: int) -> None:
        self.bar.update(n)

    def shard_done(self, name: str, written: int) -> None:
        if self.enabled and self.bar.disable:
            rate = written / max(time.monotonic() - self.start, 1e-9)
            of = f"/{self.total}" if self.total else ""
            log.info("%s: wrote %s, %d%s images (%.0f img/s)", self.split, name, written, of, rate)

    def close(self) -> None:
        self.bar.close()


def write_shards(samples: Iterable[Sample], out_dir: str | Path, *, split: str, source: str,
                 class_names: Sequence[str], mode: str, samples_per_shard: int,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 expected_count: int | None = None, build: dict[str, Any] | None = None,
                 progress: bool = True, shard_format: str = "auto",
                 pool: EncodePool | None = None) -> Manifest:
    """Write samples into ``out_dir/shard-NNNNNN.tar`` + ``manifest.json``, atomically.

    Args:
        samples: the split's samples, in the order they are stored; keys unique and matching
            ``[A-Za-z0-9_-]{1,90}``, images in ``mode``.
        out_dir: the split directory; replaced as a whole on success, untouched on failure.
        split: split name recorded in the manifest.
        source: source name recorded in the manifest.
        class_names: ``C`` class names (labels must be ``-1..C-1``).
        mode: ``"L"`` or ``"RGB"``.
        samples_per_shard: images per shard (``data.samples_per_shard``); the last shard holds
            the rest, never zero.
        mean: per-channel normalisation mean (0..1 scale); ``None`` = this split's pixel mean.
        std: per-channel normalisation std; ``None`` = this split's pixel std.
        expected_count: if given, the number of samples that must be written.
        build: extra build settings recorded verbatim under ``"build"`` (JSON-serialisable).
        progress: show a tqdm bar on a terminal, else log one line per shard.
        shard_format: ``auto``, ``png`` or ``jpeg`` (``data.shard_format``,
            :func:`~pipeline.data.encode.encode_member`).
        pool: the processes that encode (``data.build_workers``); None = this process. The
            bytes written are the same either way.

    Returns:
        The :class:`~pipeline.data.manifest.Manifest` written to ``manifest.json``.

    Raises:
        ValueError: invalid arguments.
        ShardError: no samples, a bad or duplicate key, a wrong image mode, a label out of range,
            or a count different from ``expected_count``.
    """
    if mode not in CHANNELS:
        raise InputError(f"mode must be one of {list(CHANNELS)}, got {mode!r}")
    if samples_per_shard < 1:
        raise InputError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    out_dir = Path(out_dir)
    it = iter(samples)
    first = next(it, None)
    if first is None:
        raise ShardError(f"{out_dir}: no samples for split '{split}'; nothing written")
    it = _prepend([first], it)
    del first  # held until written, not for the whole split (a 60 MP photo is 229 MiB)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    tmp.chmod(0o755)  # mkdtemp makes 0700; shards are shared data
    try:
        manifest = _write(it, tmp, split=split, source=source, class_names=class_names,
                          mode=mode, samples_per_shard=samples_per_shard, mean=mean, std=std,
                          expected_count=expected_count, build=build, progress=progress,
                          out_dir=out_dir, shard_format=shard_format,
                          pool=pool or EncodePool(1))
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _prepend(head: list[Sample], rest: Iterator[Sample]) -> Iterator[Sample]:
    """``head``'s one sample, then ``rest``; ``head`` is emptied, so nothing keeps the sample.

    (``itertools.chain`` keeps its arguments, and a generator's local variable its value.)
    """
    yield head.pop()
    yield from rest


class _SplitStats:
    """Checks each sample as it is written and accumulates what the manifest reports.

    Pixel sums are exact integers, so the statistics are reproducible bit for bit, in any
    order; the encoding processes take them from each image's histogram
    (:func:`~pipeline.data.manifest.pixel_sums`), without a copy of its pixels. Keys are held
    as 8-byte digests (a million keys in 8 MB) and checked for duplicates once the split is
    written (:meth:`check_keys`).
    """

    def __init__(self, mode: str, num_classes: int, out_dir: Path) -> None:
        self.mode, self.channels = mode, CHANNELS[mode]
        self.num_classes, self.out_dir = num_classes, out_dir
        self.digests = array("Q")  # blake2b-64 of each key, in sample order
        self.label_counts: Counter[int] = Counter()
        self.sizes: set[tuple[int, int]] = set()
        self.pix_sum = np.zeros(self.channels, dtype=np.uint64)
        self.pix_sq = np.zeros(self.channels, dtype=np.uint64)
        self.n_pix = 0

    def check(self, n: int, s: Sample) -> None:
        """Check sample ``n`` (key, mode, label) and count its size and label.

        Raises:
            ShardError: a bad key, another image mode, a label out of range.
        """
        where = f"{self.out_dir} sample {n} (key {s.key!r})"
        if not isinstance(s.key, str) or not KEY_RE.match(s.key):
            raise ShardError(f"{where}: key must match {KEY_RE.pattern}")
        self.digests.append(int.from_bytes(
            hashlib.blake2b(s.key.encode(), digest_size=8).digest(), "little"))
        if s.image.mode != self.mode:
            raise ShardError(f"{where}: image mode {s.image.mode}, expected {self.mode}")
        if not -1 <= int(s.label) < self.num_classes:
            raise ShardError(f"{where}: label {s.label} outside -1..{self.num_classes - 1}")
        self.sizes.add(s.image.size)
        self.label_counts[int(s.label)] += 1

    def check_keys(self, tmp: Path, samples_per_shard: int) -> None:
        """Refuse a key written twice (the digests that repeat, compared as the tars hold them).

        Raises:
            ShardError: a duplicate key: names it and both sample numbers.
        """
        digests = np.frombuffer(self.digests, dtype=np.uint64)
        order = np.argsort(digests, kind="stable")
        run_starts = np.flatnonzero(np.diff(digests[order], prepend=~digests[order][:1]))
        for run in np.split(order, run_starts[1:]):
            if len(run) < 2:
                continue
            seen: dict[str, int] = {}  # the keys of one digest (distinct keys: a collision)
            for n in sorted(run.tolist()):
                key = sample_key_at(tmp, n, samples_per_shard)
                if key in seen:
                    raise ShardError(f"{self.out_dir} sample {n} (key {key!r}): duplicate "
                                     f"key (sample {seen[key]})")
                seen[key] = n

    def add_pixels(self, e: Encoded) -> None:
        """Add the pixel sums of an encoded chunk of samples."""
        self.pix_sum += np.array(e.sums, np.uint64)
        self.pix_sq += np.array(e.squares, np.uint64)
        self.n_pix += e.pixels

    def fields(self, mean: Sequence[float] | None, std: Sequence[float] | None) -> dict[str, Any]:
        """The :class:`Manifest` statistics fields (shape, mean/std, pixel stats, label counts)."""
        pixel_mean, pixel_std = pixel_stats(self.pix_sum, self.pix_sq, self.n_pix)
        (w, h), = self.sizes if len(self.sizes) == 1 else [(None, None)]
        return {
            "image_shape": (self.channels, h, w) if h is not None else None,  # None = mixed
            "mean": round6(pixel_mean if mean is None else mean),
            "std": round6(pixel_std if std is None else std),
            "pixel_mean": round6(pixel_mean), "pixel_std": round6(pixel_std),
            "label_counts": {str(k): self.label_counts[k] for k in sorted(self.label_counts)},
        }


def _write_tars(samples: Iterator[Sample], tmp: Path, *, stats: _SplitStats,
                samples_per_shard: int, bar: _Progress, shard_format: str,
                kinds: Counter[str], pool: EncodePool) -> list[int]:
    """Write the samples into ``tmp/shard-NNNNNN.tar``; returns the count per shard.

    ``kinds`` counts how the images were stored (:data:`MEMBER_KINDS`). ``pool`` encodes the
    samples in chunks (:class:`~pipeline.data.encode_pool.EncodePool`: bounded pixels on their
    way), written here in the samples' order.
    """
    counts: list[int] = []
    out = None
    size = 0  # bytes of members in the open shard
    try:
        n = 0
        for chunk in pool.encode(samples, shard_format, stats.check):
            stats.add_pixels(chunk)
            kinds.update(chunk.kinds)
            pending: list[bytes] = []  # one write per chunk and shard
            for members in chunk.members:
                if n % samples_per_shard == 0:
                    if out is not None:
                        out.write(b"".join(pending) + tar_end(size))
                        out.close()
                        bar.shard_done(SHARD_PATTERN % (len(counts) - 1), n)
                    out, size, pending = open(tmp / (SHARD_PATTERN % len(counts)), "wb"), 0, []
                    counts.append(0)
                pending.append(members)
                size += len(members)
                counts[-1] += 1
                n += 1
            assert out is not None
            out.write(b"".join(pending))
            bar.update(len(chunk.members))
            del chunk, pending  # not held while the next one is encoded
        if out is not None:
            out.write(tar_end(size))
    finally:
        if out is not None:
            out.close()
    bar.shard_done(SHARD_PATTERN % (len(counts) - 1), sum(counts))
    return counts


def _shard_table(tmp: Path, counts: list[int], out_dir: Path) -> tuple[ShardEntry, ...]:
    """Name, sample count, bytes and sha256 of every written shard.

    Raises:
        ShardError: the files on disk are not exactly the shards written.
    """
    shards = []
    for i, count in enumerate(counts):
        path = tmp / (SHARD_PATTERN % i)
        shards.append(ShardEntry(name=path.name, num_samples=count,
                                 bytes=path.stat().st_size, sha256=sha256_file(path)))
    on_disk = sorted(p.name for p in tmp.glob("*.tar"))
    if on_disk != [s.name for s in shards]:  # a shard opened and never filled
        raise ShardError(f"{out_dir}: shard files {on_disk} differ from those written")
    return tuple(shards)


def _write(samples: Iterator[Sample], tmp: Path, *, split: str, source: str,
           class_names: Sequence[str], mode: str, samples_per_shard: int,
           mean: Sequence[float] | None, std: Sequence[float] | None,
           expected_count: int | None, build: dict[str, Any] | None, progress: bool,
           out_dir: Path, shard_format: str, pool: EncodePool) -> Manifest:
    stats = _SplitStats(mode, len(class_names), out_dir)
    bar = _Progress(split, expected_count, progress)
    kinds: Counter[str] = Counter()
    try:
        counts = _write_tars(samples, tmp, stats=stats,
                             samples_per_shard=samples_per_shard, bar=bar,
                             shard_format=shard_format, kinds=kinds, pool=pool)
    finally:
        bar.close()
    stats.check_keys(tmp, samples_per_shard)
    total = sum(counts)
    if expected_count is not None and total != expected_count:
        raise ShardError(f"{out_dir}: wrote {total} samples for split '{split}', expected "
                         f"{expected_count}")
    build = dict(build or {})
    if kinds["png"] != total:  # JPEG members: say so (a PNG-only manifest is as it always was)
        build.update(shard_format=str(shard_format), jpeg_quality=JPEG_QUALITY,
                     members={k: kinds[k] for k in MEMBER_KINDS})
    manifest = Manifest(source=source, split=split, num_samples=total,
                        samples_per_shard=samples_per_shard, class_names=tuple(class_names),
                        mode=mode, **stats.fields(mean, std), build=build,
                        shards=_shard_table(tmp, counts, out_dir))
    write_manifest(manifest, tmp)
    return manifest


def empty_split(out_dir: Path, *, split: str, source: str, class_names: Sequence[str],
                mode: str, build: dict[str, Any]) -> Manifest:
    """Write the manifest of a split without images (``data.source: none``: no train/test).

    Returns:
        The :class:`~pipeline.data.manifest.Manifest` (``num_samples`` 0, no shards).
    """
    manifest = Manifest(source=source, split=split, num_samples=0, samples_per_shard=0,
                        class_names=tuple(class_names), mode=mode, image_shape=None, mean=(),
                        std=(), pixel_mean=(), pixel_std=(), label_counts={}, build=build,
                        shards=())
    write_manifest(manifest, out_dir)
    return manifest


def open_data(params: DataParams, seed: int) -> tuple[Source, dict[str, Any]]:
    """The source ``build_all`` writes: the labelled source, with the unlabelled tree mixed in.

    Returns:
        ``(source, record)``: the source (its ``pretrain`` split already the union, see
        :class:`pipeline.data.sources.unlabelled.PretrainMix`) and what the pretrain manifest
        records about the unlabelled tree (``{}`` without one).

    Raises:
        SourceError: raw data missing or invalid.
        ShardError: webdataset shards unreadable or too many broken.
    """
    from pipeline.data.folder_index import broken_in_folder, read_previous_folders
    from pipeline.data.index import read_previous

    index = read_previous("labelled") if params.source == "webdataset" else None
    folders = read_previous_folders()  # the broken files index_shards found and let through
    src = open_source(params.source, params.root, download=params.download,
                      test_fraction=params.test_fraction, seed=seed,
                      label_field=params.label_field,
                      max_broken_fraction=params.max_broken_fraction, index=index,
                      exclude=broken_in_folder("data.root", params.root, folders,
                                               params.max_broken_fraction))
    if getattr(src, "broken", 0):
        log.info("data.root %s: %d broken image(s) left out (data/index/folders.json)",
                 params.root, src.broken)
    if not params.unlabelled_root and params.pretrain_labelled:
        return src, {}
    tree = (UnlabelledTree(params.unlabelled_root, exclude=broken_in_folder(
        "data.unlabelled_root", params.unlabelled_root, folders, params.max_broken_fraction))
        if params.unlabelled_root else None)
    mix = PretrainMix(src, tree, include_labelled=params.pretrain_labelled,
                      resized=bool(params.image_size or params.max_side))
    record = {"pretrain_labelled": params.pretrain_labelled}
    if tree is not None:
        record["unlabelled"] = tree.build_record()
        broken = (f"; {tree.broken} broken left out (data/index/folders.json)"
                  if tree.broken else "")
        log.info("unlabelled tree %s: %d images, skipped %s%s", tree.root, len(tree),
                 tree.describe_skipped(), broken)
    return mix, record


def _log_tree_share(manifest: Manifest, tree_images: int, cap: int) -> None:
    """Say how many ``data.unlabelled_root`` images the built pretrain split holds.

    ``data.max_pretrain_images`` keeps each label's share, the tree's label -1 included, so a
    small folder beside a large labelled set can lose most or all of its images to the cap: a
    warning says so and how to keep them.
    """
    used = int((manifest.label_counts or {}).get("-1", 0))
    if used == tree_images:
        log.info("pretrain: all %d images of data.unlabelled_root are in the split", used)
        return
    log.warning("pretrain: %d of the %d images of data.unlabelled_root are in the split: "
                "data.max_pretrain_images = %d keeps each label's share, the folder's included "
                "(0 keeps every image; data.pretrain_labelled: false leaves the cap to the "
                "folder)", used, tree_images, cap)


def rerun_hint(shards_dir: str) -> str:
    """What to do about image files that broke after ``index_shards`` decoded them.

    ``dvc repro`` has deleted the shards before ``build_shards`` runs; ``dvc checkout`` brings
    the last ones back from the cache.
    """
    return (f"fix or remove them and rerun (`dvc checkout {shards_dir}` restores the last shards "
            "built)")


def _build_split(src: Source, split: str, out_dir: Path, *, params: DataParams, seed: int,
                 record: dict[str, Any], mean: Sequence[float] | None,
                 std: Sequence[float] | None, progress: bool, pool: EncodePool) -> Manifest:
    """Write one split of ``src`` into ``out_dir`` (:func:`build_all` does each in turn).

    Args:
        src: the source (:func:`open_data`).
        split: ``pretrain``, ``train`` or ``test``.
        out_dir: the split's directory (in :func:`build_all`'s temporary tree).
        params: as :func:`build_all`'s.
        seed: the global ``seed``: the cap's subset and the write order.
        record: what the manifest's ``build`` records besides the settings (the pretrain
            split's unlabelled tree, :func:`open_data`); ``{}`` for the other splits.
        mean: the per-channel normalisation mean recorded, or None (the split's own pixel
            statistics).
        std: the per-channel std, or None (as ``mean``).
        progress: progress bar / log lines.
        pool: the encoding processes (``data.build_workers``).

    Returns:
        The split's manifest.

    Raises:
        SourceError: an image does not decode: names the split and the file, and how to get
            the last shards back.
    """
    cap = {"pretrain": params.max_pretrain_images, "train": params.max_train_images,
           "test": params.max_test_images}[split]
    max_side = getattr(params, "max_side", 0)
    n = src.count(split)
    build = {"seed": seed, "max_images": cap, "image_size": params.image_size,
             **({"max_side": max_side} if max_side else {}),
             "test_fraction": params.test_fraction, **src.build_settings, **record}
    if n == 0:
        return empty_split(out_dir, split=split, source=src.name, class_names=src.class_names,
                           mode=src.mode, build=build)
    samples: Iterable[Sample] = src.iter(split, max_images=cap, seed=seed, shuffle=True)
    if max_side:
        samples = limit_short_side(samples, max_side)
    elif params.image_size:
        samples = resize_samples(samples, params.image_size)
    try:
        m = write_shards(samples, out_dir, split=split, source=src.name,
                         class_names=src.class_names, mode=src.mode,
                         samples_per_shard=params.samples_per_shard, mean=mean, std=std,
                         expected_count=min(cap, n) if cap else n, build=build,
                         progress=progress, shard_format=str(params.shard_format), pool=pool)
    except BrokenImages as e:  # pixels that broke after index_shards decoded them
        raise SourceError(f"split {split}: {e}; {rerun_hint(params.shards_dir)}") from None
    if "unlabelled" in record:
        _log_tree_share(m, int(record["unlabelled"]["images"]), cap)
    return m


def build_all(params: DataParams, seed: int, *, progress: bool = True) -> dict[str, Manifest]:
    """Build the ``pretrain``, ``train`` and ``test`` shards under ``params.shards_dir``.

    Each split is written in a seeded random order (so a shard, and any prefix a loader takes
    with ``max_images``, mixes all classes). All three splits are built into a temporary
    directory that then replaces ``shards_dir`` as a whole. The pretrain split is the labelled
    source's own (``data.pretrain_labelled``) and the ``data.unlabelled_root`` images (label
    -1), capped together by ``data.max_pretrain_images``; a split without images (no labelled
    source, or pretraining only from ``data.pretrain_shards``) gets a manifest with no shards.

    Normalisation: the source's published mean/std; otherwise (ImageFolder, webdataset, or
    a mode changed by the unlabelled images) the pixel mean/std of the pretrain split as built,
    or of the train split when the pretrain split is empty, recorded in all three manifests.

    Args:
        params: a :class:`pipeline.config.DataParams` (``source``, ``root``, ``download``,
            ``image_size``, ``max_*_images``, ``samples_per_shard``, ``shard_format``,
            ``test_fraction``,
            ``shards_dir``, ``unlabelled_root``, ``pretrain_labelled``, ``label_field``,
            ``max_broken_fraction``).
        seed: the global ``seed`` (ImageFolder split, caps, write order).
        progress: progress bar / log lines.

    Returns:
        ``{split: manifest}``.

    Raises:
        SourceError: raw data missing or invalid; an image whose header or pixels do not
            decode names its file (and split), and how to get the last shards back (``dvc
            repro`` deleted them: :func:`rerun_hint`).
        ShardError: a URL ``shards_dir``; unreadable webdataset shards.
    """
    if isinstance(shards_location(params.shards_dir), ShardURL):
        raise ShardError(f"data.shards_dir = {params.shards_dir}: build_shards writes a local "
                         "directory; images on a URL come in through data.pretrain_shards "
                         "(pretraining, read in place) and data.source webdataset (the labelled "
                         "data), indexed by the index_shards stage (docs/data.md)")
    try:
        src, record = open_data(params, seed)
    except BrokenImages as e:  # headers that broke after index_shards decoded the files
        raise SourceError(f"{e}; {rerun_hint(params.shards_dir)}") from None
    out = Path(params.shards_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    tmp.chmod(0o755)
    mean, std = src.mean, src.std
    manifests = {}
    workers = resolve_workers(params.build_workers)
    log.info("build_shards: %d encoding process(es) (data.build_workers: %s)", workers,
             params.build_workers)
    try:
        with EncodePool(workers) as pool:
            for split in SPLITS:
                m = _build_split(src, split, tmp / split, params=params, seed=seed,
                                 record=record if split == "pretrain" else {}, mean=mean,
                                 std=std, progress=progress, pool=pool)
                if mean is None and m.num_samples:  # no published stats: the first split built
                    mean, std = m.pixel_mean, m.pixel_std
                manifests[split] = m
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifests
