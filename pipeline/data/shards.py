"""Deterministic WebDataset shards, their manifest, and verification.

A split directory holds ``shard-000000.tar``, ``shard-000001.tar``, ... and ``manifest.json``.
Each sample is two tar members: ``<key>.png`` (lossless PNG, encoded by PIL with fixed options
and no metadata) and ``<key>.cls`` (the integer label as ASCII text, ``-1`` = unlabelled).
Tar headers carry a constant mtime, owner and mode, so rebuilding from the same source, caps and
seed gives byte-identical shards (and DVC sees no change downstream).

Every image is re-encoded as PNG, also for ImageFolder JPEGs: the stored pixels are then exactly
what the mode conversion/resize produced, at the cost of larger shards for photographs.

The manifest lists the shards in order with their sample count, byte size and sha256, plus the
class names, image mode and shape, and the normalisation ``mean``/``std`` the loaders should use.
Outputs are built in a temporary sibling directory and swapped in with ``os.replace``, so a
failure leaves the previous outputs untouched.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import webdataset as wds
from PIL import Image
from tqdm import tqdm

from pipeline.data.remote import RemoteError, ShardURL, open_stream, read_url, shards_location
from pipeline.data.sources import SPLITS, Sample, open_source

if TYPE_CHECKING:
    from pipeline.config import DataParams

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "moco-pipeline-shards/1"
SHARD_PATTERN = "shard-%06d.tar"
_SHARD_NAME_RE = re.compile(r"^shard-\d{6}\.tar$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,90}$")
IMAGE_EXTS = ("png", "jpg", "jpeg")
LABEL_EXT = "cls"
# members that would need unpickling (or are otherwise unknown) are refused by the readers
_PICKLE_EXTS = ("pyd", "pickle", "pkl", "pth", "pt", "npy", "npz")
_PNG_OPTIONS = {"format": "PNG", "compress_level": 6, "optimize": False}  # Pillow's default level
_TAR_OPTIONS = {"mtime": 0, "user": "moco", "group": "moco", "mode": 0o444}
_MODES = {"L": 1, "RGB": 3}


class ShardError(Exception):
    """Shards or a manifest that are missing, inconsistent or corrupt (message names the path)."""


# --- writing ---------------------------------------------------------------------------------


def encode_png(image: Image.Image) -> bytes:
    """Encode an image as PNG with fixed options and no metadata (byte-reproducible).

    Args:
        image: PIL image in mode ``L`` or ``RGB``.

    Returns:
        The PNG bytes.
    """
    if image.info:  # ICC profiles etc. would be copied into the PNG
        image = image.copy()
        image.info = {}
    buf = io.BytesIO()
    image.save(buf, **_PNG_OPTIONS)
    return buf.getvalue()


def resize_samples(samples: Iterable[Sample], image_size: int) -> Iterator[Sample]:
    """Resize the shorter side to ``image_size`` (bicubic, antialiased), then center-crop square.

    Args:
        samples: source samples.
        image_size: output side in pixels (``data.image_size``); must be > 0.

    Yields:
        Samples with ``image_size`` x ``image_size`` images, same key, label and mode.
    """
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    for s in samples:
        img = F.resize(s.image, image_size, interpolation=InterpolationMode.BICUBIC,
                       antialias=True)
        yield Sample(s.key, F.center_crop(img, [image_size, image_size]), s.label)


def limit_short_side(samples: Iterable[Sample], max_side: int) -> Iterator[Sample]:
    """Shrink images whose shorter side exceeds ``max_side`` so it equals it; no crop.

    The aspect ratio is kept (the longer side is rounded as torchvision's ``Resize(int)`` does),
    so RandomResizedCrop later samples from the whole photo as in the official MoCo code.
    Images already within ``max_side`` are stored unchanged (never upsampled).

    Args:
        samples: source samples.
        max_side: the largest shorter side in pixels (``data.max_side``); must be > 0.

    Yields:
        Samples with ``min(W, H) <= max_side``, same key, label and mode.
    """
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    for s in samples:
        img = s.image
        if min(img.size) > max_side:
            img = F.resize(img, max_side, interpolation=InterpolationMode.BICUBIC, antialias=True)
        yield Sample(s.key, img, s.label)


def sha256_file(path: str | Path) -> str:
    """Hex sha256 (64 characters) of a file's bytes, read in 1 MiB blocks.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    """tqdm on a terminal, otherwise a log line per finished shard."""

    def __init__(self, split: str, total: int | None, enabled: bool):
        self.split, self.total, self.enabled = split, total, enabled
        self.bar = (tqdm(total=total, desc=f"shards {split}", unit="img")
                    if enabled and sys.stderr.isatty() else None)
        self.start = time.monotonic()

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def shard_done(self, name: str, written: int) -> None:
        if self.enabled and self.bar is None:
            rate = written / max(time.monotonic() - self.start, 1e-9)
            of = f"/{self.total}" if self.total else ""
            log.info("%s: wrote %s, %d%s images (%.0f img/s)", self.split, name, written, of, rate)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def write_shards(samples: Iterable[Sample], out_dir: str | Path, *, split: str, source: str,
                 class_names: Sequence[str], mode: str, samples_per_shard: int,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 expected_count: int | None = None, build: dict[str, Any] | None = None,
                 progress: bool = True) -> dict[str, Any]:
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

    Returns:
        The manifest dict (as written to ``manifest.json``).

    Raises:
        ValueError: invalid arguments.
        ShardError: no samples, a bad or duplicate key, a wrong image mode, a label out of range,
            or a count different from ``expected_count``.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {list(_MODES)}, got {mode!r}")
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    out_dir = Path(out_dir)
    it = iter(samples)
    first = next(it, None)
    if first is None:
        raise ShardError(f"{out_dir}: no samples for split '{split}'; nothing written")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    tmp.chmod(0o755)  # mkdtemp makes 0700; shards are shared data
    try:
        manifest = _write(first, it, tmp, split=split, source=source, class_names=class_names,
                          mode=mode, samples_per_shard=samples_per_shard, mean=mean, std=std,
                          expected_count=expected_count, build=build, progress=progress,
                          out_dir=out_dir)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


class _SplitStats:
    """Checks each sample as it is written and accumulates what the manifest reports.

    Pixel sums are exact integers, so the statistics are reproducible bit for bit.
    """

    def __init__(self, mode: str, num_classes: int, out_dir: Path) -> None:
        self.mode, self.channels = mode, _MODES[mode]
        self.num_classes, self.out_dir = num_classes, out_dir
        self.keys: set[str] = set()
        self.label_counts: Counter[int] = Counter()
        self.sizes: set[tuple[int, int]] = set()
        self.pix_sum = np.zeros(self.channels, dtype=np.uint64)
        self.pix_sq = np.zeros(self.channels, dtype=np.uint64)
        self.n_pix = 0

    def add(self, n: int, s: Sample) -> None:
        """Check sample ``n`` (key, mode, label) and add it to the statistics.

        Raises:
            ShardError: a bad or duplicate key, another image mode, a label out of range.
        """
        where = f"{self.out_dir} sample {n} (key {s.key!r})"
        if not isinstance(s.key, str) or not _KEY_RE.match(s.key):
            raise ShardError(f"{where}: key must match {_KEY_RE.pattern}")
        if s.key in self.keys:
            raise ShardError(f"{where}: duplicate key")
        self.keys.add(s.key)
        if s.image.mode != self.mode:
            raise ShardError(f"{where}: image mode {s.image.mode}, expected {self.mode}")
        if not -1 <= int(s.label) < self.num_classes:
            raise ShardError(f"{where}: label {s.label} outside -1..{self.num_classes - 1}")
        arr = np.asarray(s.image).reshape(-1, self.channels)
        self.pix_sum += arr.sum(axis=0, dtype=np.uint64)
        self.pix_sq += np.square(arr, dtype=np.uint64).sum(axis=0, dtype=np.uint64)
        self.n_pix += arr.shape[0]
        self.sizes.add(s.image.size)
        self.label_counts[int(s.label)] += 1

    def fields(self, mean: Sequence[float] | None, std: Sequence[float] | None) -> dict[str, Any]:
        """The manifest's statistics fields (shape, mean/std, pixel stats, label counts)."""
        pixel_mean = self.pix_sum / (255.0 * self.n_pix)
        pixel_var = self.pix_sq / (255.0**2 * self.n_pix) - pixel_mean**2
        pixel_std = np.sqrt(np.maximum(pixel_var, 0.0))
        (w, h), = self.sizes if len(self.sizes) == 1 else [(None, None)]

        def r6(xs: Any) -> list[float]:
            return [round(float(x), 6) for x in xs]

        return {
            "image_shape": [self.channels, h, w] if h is not None else None,  # None = mixed
            "mean": r6(pixel_mean if mean is None else mean),
            "std": r6(pixel_std if std is None else std),
            "pixel_mean": r6(pixel_mean), "pixel_std": r6(pixel_std),
            "label_counts": {str(k): self.label_counts[k] for k in sorted(self.label_counts)},
        }


def _write_tars(samples: Iterator[Sample], tmp: Path, *, stats: _SplitStats,
                samples_per_shard: int, bar: _Progress) -> list[int]:
    """Write the samples into ``tmp/shard-NNNNNN.tar``; returns the count per shard."""
    counts: list[int] = []
    with wds.ShardWriter(str(tmp / SHARD_PATTERN), maxcount=samples_per_shard,
                         maxsize=float("inf"), verbose=0, encoder=False, **_TAR_OPTIONS) as writer:
        for n, s in enumerate(samples):
            stats.add(n, s)
            if n % samples_per_shard == 0:
                if counts:
                    bar.shard_done(SHARD_PATTERN % (len(counts) - 1), n)
                counts.append(0)
            writer.write({"__key__": s.key, "png": encode_png(s.image),
                          LABEL_EXT: str(int(s.label)).encode("ascii")})
            counts[-1] += 1
            bar.update(1)
    bar.shard_done(SHARD_PATTERN % (len(counts) - 1), sum(counts))
    return counts


def _shard_table(tmp: Path, counts: list[int], out_dir: Path) -> list[dict[str, Any]]:
    """Name, sample count, bytes and sha256 of every written shard.

    Raises:
        ShardError: the files on disk are not exactly the shards written.
    """
    shards = []
    for i, count in enumerate(counts):
        path = tmp / (SHARD_PATTERN % i)
        shards.append({"name": path.name, "num_samples": count, "bytes": path.stat().st_size,
                       "sha256": sha256_file(path)})
    on_disk = sorted(p.name for p in tmp.glob("*.tar"))
    if on_disk != [s["name"] for s in shards]:  # ShardWriter opened a shard it never filled
        raise ShardError(f"{out_dir}: shard files {on_disk} differ from those written")
    return shards


def _write(first: Sample, rest: Iterator[Sample], tmp: Path, *, split: str, source: str,
           class_names: Sequence[str], mode: str, samples_per_shard: int,
           mean: Sequence[float] | None, std: Sequence[float] | None,
           expected_count: int | None, build: dict[str, Any] | None, progress: bool,
           out_dir: Path) -> dict[str, Any]:
    stats = _SplitStats(mode, len(class_names), out_dir)
    bar = _Progress(split, expected_count, progress)
    try:
        counts = _write_tars(_chain(first, rest), tmp, stats=stats,
                             samples_per_shard=samples_per_shard, bar=bar)
    finally:
        bar.close()
    total = sum(counts)
    if expected_count is not None and total != expected_count:
        raise ShardError(f"{out_dir}: wrote {total} samples for split '{split}', expected "
                         f"{expected_count}")
    manifest = {"format": MANIFEST_FORMAT, "source": source, "split": split,
                "num_samples": total, "samples_per_shard": samples_per_shard,
                "class_names": list(class_names), "mode": mode, **stats.fields(mean, std),
                "build": build or {}, "shards": _shard_table(tmp, counts, out_dir)}
    (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _chain(first: Sample, rest: Iterator[Sample]) -> Iterator[Sample]:
    yield first
    yield from rest


def build_all(params: DataParams, seed: int, *, progress: bool = True) -> dict[str, dict[str, Any]]:
    # Long only by its signature and docstring (the protocol, shapes, errors): the body is 41 lines.
    """Build the ``pretrain``, ``train`` and ``test`` shards under ``params.shards_dir``.

    Each split is written in a seeded random order (so a shard, and any prefix a loader takes
    with ``max_images``, mixes all classes). All three splits are built into a temporary
    directory that then replaces ``shards_dir`` as a whole.

    Normalisation: the source's published mean/std; for ImageFolder (none published) the pixel
    mean/std of the pretrain split as built, recorded in all three manifests.

    Args:
        params: a :class:`pipeline.config.DataParams` (``source``, ``root``, ``download``,
            ``image_size``, ``max_*_images``, ``samples_per_shard``, ``test_fraction``,
            ``shards_dir``).
        seed: the global ``seed`` (ImageFolder split, caps, write order).
        progress: progress bar / log lines.

    Returns:
        ``{split: manifest}``.

    Raises:
        SourceError: raw data missing or invalid.
        ShardError: a split without samples.
    """
    if isinstance(shards_location(params.shards_dir), ShardURL):
        raise ShardError(f"data.shards_dir = {params.shards_dir}: build_shards writes a local "
                         "directory; a URL is for reading shards published elsewhere (build "
                         "into a local shards_dir, then copy or `dvc push` them there)")
    max_side = getattr(params, "max_side", 0)
    src = open_source(params.source, params.root, download=params.download,
                      test_fraction=params.test_fraction, seed=seed)
    caps = {"pretrain": params.max_pretrain_images, "train": params.max_train_images,
            "test": params.max_test_images}
    out = Path(params.shards_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    tmp.chmod(0o755)
    mean, std = src.mean, src.std
    manifests = {}
    try:
        for split in SPLITS:
            samples: Iterable[Sample] = src.iter(split, max_images=caps[split], seed=seed,
                                                 shuffle=True)
            if max_side:
                samples = limit_short_side(samples, max_side)
            elif params.image_size:
                samples = resize_samples(samples, params.image_size)
            n = src.count(split)
            m = write_shards(samples, tmp / split, split=split, source=src.name,
                             class_names=src.class_names, mode=src.mode,
                             samples_per_shard=params.samples_per_shard, mean=mean, std=std,
                             expected_count=min(caps[split], n) if caps[split] else n,
                             build={"seed": seed, "max_images": caps[split],
                                    "image_size": params.image_size,
                                    **({"max_side": max_side} if max_side else {}),
                                    "test_fraction": params.test_fraction,
                                    **src.build_settings},
                             progress=progress)
            if mean is None:  # no published stats: use the pretrain split's pixel stats
                mean, std = m["pixel_mean"], m["pixel_std"]
            manifests[split] = m
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifests


# --- reading and verification ----------------------------------------------------------------


def read_manifest(directory: str | Path | ShardURL) -> dict[str, Any]:
    """Load and validate a split's ``manifest.json``.

    Args:
        directory: the split directory, or its URL (``https://…/pretrain``, ``s3://…``).

    Returns:
        The manifest dict; ``shards`` in storage order.

    Raises:
        ShardError: missing file, invalid JSON, or a missing/inconsistent field (names the file
            or URL).
    """
    location = shards_location(directory)
    path = location / MANIFEST_NAME
    if isinstance(path, ShardURL):
        try:
            text = read_url(path)
        except RemoteError as e:
            raise ShardError(f"{e} (manifest not found or unreadable)") from None
    else:
        if not path.is_file():
            raise ShardError(f"{path}: manifest not found (build the shards first)")
        text = None
    try:
        m = json.loads(path.read_text() if text is None else text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardError(f"{path}: not a readable JSON manifest ({e})") from None

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ShardError(f"{path}: invalid manifest: {what}")

    need(isinstance(m, dict) and m.get("format") == MANIFEST_FORMAT,
         f"'format' must be {MANIFEST_FORMAT!r}")
    for field, typ in (("source", str), ("split", str), ("num_samples", int), ("mode", str),
                       ("class_names", list), ("mean", list), ("std", list), ("shards", list)):
        need(isinstance(m.get(field), typ), f"'{field}' missing or not a {typ.__name__}")
    need(m["mode"] in _MODES, f"'mode' must be one of {list(_MODES)}")
    need(len(m["mean"]) == len(m["std"]) == _MODES[m["mode"]], "'mean'/'std' length != channels")
    need(len(m["shards"]) > 0, "no shards")
    names = []
    for i, s in enumerate(m["shards"]):
        need(isinstance(s, dict) and isinstance(s.get("name"), str)
             and bool(_SHARD_NAME_RE.match(s["name"])), f"shards[{i}].name invalid")
        need(isinstance(s.get("num_samples"), int) and s["num_samples"] > 0,
             f"shards[{i}].num_samples must be a positive int")
        need(isinstance(s.get("bytes"), int) and isinstance(s.get("sha256"), str),
             f"shards[{i}] needs 'bytes' and 'sha256'")
        names.append(s["name"])
    need(names == sorted(set(names)), "shard names must be unique and sorted")
    need(sum(s["num_samples"] for s in m["shards"]) == m["num_samples"],
         "'num_samples' != sum of the shards' num_samples")
    return m


def iter_shard(path: str | Path | ShardURL, *, expect: tuple[int, str] | None = None
               ) -> Iterator[dict[str, Any]]:
    """Yield the raw samples (``{"__key__", "__url__", ext: bytes}``) of one shard.

    A URL is streamed (:func:`pipeline.data.remote.open_stream`: retries with backoff) and
    hashed as it is read; with ``expect`` the byte count and sha256 are compared with the
    manifest once the stream is exhausted, so the error comes after the shard's samples (a
    caller that stops early skips the check). Local files are read as they are (callers check
    them beforehand, see ``pipeline.data.loader``).

    Args:
        path: a local shard file or a shard URL.
        expect: ``(bytes, sha256)`` from the manifest, checked at the end of a URL.

    Raises:
        ShardError: the tar cannot be read, the URL failed, or ``expect`` differs (names the
            shard).
    """
    if isinstance(path, ShardURL) or (isinstance(path, str) and isinstance(
            shards_location(path), ShardURL)):
        yield from _iter_url_shard(str(path), expect)
        return
    try:
        yield from wds.tarfile_samples([{"url": str(path)}])
    except Exception as e:  # tarfile / gopen errors
        raise ShardError(f"{path}: unreadable shard ({type(e).__name__}: {e})") from None


def _iter_url_shard(url: str, expect: tuple[int, str] | None) -> Iterator[dict[str, Any]]:
    from webdataset.tariterators import group_by_keys, tar_file_expander

    try:
        raw = open_stream(url)
    except RemoteError as e:
        raise ShardError(str(e)) from None
    with raw, io.BufferedReader(raw, buffer_size=1 << 20) as stream:
        try:
            yield from group_by_keys(tar_file_expander([{"url": url, "stream": stream}]))
            while stream.read(1 << 20):  # tar end padding: hash every byte
                pass
        except RemoteError as e:
            raise ShardError(str(e)) from None
        except Exception as e:  # noqa: BLE001 (tarfile errors, wrapped by webdataset)
            if isinstance(e.__context__, RemoteError):
                raise ShardError(str(e.__context__)) from None
            why = str(e.args[0]).split(" @ ")[0] if e.args else ""
            raise ShardError(f"{url}: unreadable shard at byte {raw.pos} "
                             f"({type(e).__name__}: {why}); truncated or corrupt") from None
    if expect is not None:
        nbytes, sha = expect
        if raw.pos != nbytes:
            raise ShardError(f"{url}: {raw.pos} bytes, manifest says {nbytes} (truncated or "
                             "altered)")
        digest = raw.sha256.hexdigest()
        if digest != sha:
            raise ShardError(f"{url}: sha256 {digest[:16]}... != manifest {sha[:16]}... "
                             "(altered)")


def unsafe_key_reason(key: Any) -> str | None:
    """Why a member key read from a shard is refused, or None when it is acceptable.

    Keys of shards written elsewhere may hold ``/`` (sub-folders inside the tar), but never a
    ``..`` component, an absolute path (``/…``, a backslash or a drive letter ``C:``) or a NUL
    character: nothing is extracted by key today, but a key is a path to anyone who does.
    """
    if not isinstance(key, str) or not key:
        return "not a non-empty string"
    if "\0" in key:
        return "holds a NUL character"
    if key.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", key):
        return "an absolute path"
    if ".." in re.split(r"[/\\]", key):
        return "a '..' path component"
    return None


def check_members(record: dict[str, Any]) -> dict[str, Any]:
    """Refuse samples whose key is unsafe or whose members are not one image and one ``.cls``.

    Args:
        record: a raw WebDataset sample.

    Returns:
        ``record`` unchanged.

    Raises:
        ShardError: an unsafe key (:func:`unsafe_key_reason`), a pickle-like or unknown member,
            or a missing image/label (names the shard and the key).
    """
    bad_key = unsafe_key_reason(record.get("__key__"))
    if bad_key:
        raise ShardError(f"{record.get('__url__')}: member key {record.get('__key__')!r} "
                         f"refused ({bad_key})")
    where = f"{record.get('__url__')}: sample '{record.get('__key__')}'"
    exts = [k for k in record if not k.startswith("__")]
    for ext in exts:
        if ext in _PICKLE_EXTS:
            raise ShardError(f"{where}: member '.{ext}' refused (would need unpickling)")
        if ext not in (*IMAGE_EXTS, LABEL_EXT):
            raise ShardError(f"{where}: unexpected member '.{ext}'")
    if sum(e in IMAGE_EXTS for e in exts) != 1 or LABEL_EXT not in exts:
        raise ShardError(f"{where}: needs one image ({'/'.join(IMAGE_EXTS)}) and a .cls, "
                         f"has {exts}")
    return record


def decode_record(record: dict[str, Any], mode: str) -> tuple[str, Image.Image, int]:
    """Decode a raw sample with PIL (never unpickling).

    Args:
        record: a raw WebDataset sample.
        mode: the manifest's image mode; other modes are converted to it.

    Returns:
        ``(key, image, label)``.

    Raises:
        ShardError: disallowed members, an undecodable image or a non-integer label.
    """
    check_members(record)
    where = f"{record.get('__url__')}: sample '{record.get('__key__')}'"
    data = next(record[e] for e in IMAGE_EXTS if e in record)
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            image = im if im.mode == mode else im.convert(mode)
    except Exception as e:  # PIL raises several types
        raise ShardError(f"{where}: undecodable image ({type(e).__name__}: {e})") from None
    try:
        label = int(record[LABEL_EXT].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ShardError(f"{where}: .cls is not an integer") from None
    return record["__key__"], image, label


def verify_shards(directory: str | Path | ShardURL) -> dict[str, Any]:
    """Check a split directory against its manifest, decoding every image.

    Checks: the ``*.tar`` files present equal the manifest's list (local directories only: a
    URL cannot be listed); each shard's byte size and sha256 (for a URL while it streams); each
    sample has one decodable image and an integer label in ``-1..C-1``; keys are unique;
    per-shard counts match.

    Args:
        directory: the split directory, or its URL.

    Returns:
        ``{"dir", "split", "source", "num_shards", "num_samples", "bytes"}``.

    Raises:
        ShardError: the first problem found, naming the shard (or manifest) path.
    """
    directory = shards_location(directory)
    m = read_manifest(directory)
    listed = [s["name"] for s in m["shards"]]
    if isinstance(directory, ShardURL):
        return _verify_url(directory, m)
    present = sorted(p.name for p in directory.glob("*.tar"))
    for name in listed:
        if name not in present:
            raise ShardError(f"{directory / name}: shard listed in the manifest is missing")
    for name in present:
        if name not in listed:
            raise ShardError(f"{directory / name}: shard not listed in {MANIFEST_NAME}")
    keys: set[str] = set()
    for s in m["shards"]:
        path = directory / s["name"]
        size = path.stat().st_size
        if size != s["bytes"]:
            raise ShardError(f"{path}: {size} bytes, manifest says {s['bytes']} (truncated or "
                             "altered)")
        digest = sha256_file(path)
        if digest != s["sha256"]:
            raise ShardError(f"{path}: sha256 {digest} != manifest {s['sha256']} (altered)")
        _verify_samples(iter_shard(path), path, s["num_samples"], m, keys)
    return {"dir": str(directory), "split": m["split"], "source": m["source"],
            "num_shards": len(listed), "num_samples": m["num_samples"],
            "bytes": sum(s["bytes"] for s in m["shards"])}


def _verify_samples(records: Iterator[dict[str, Any]], where: Path | ShardURL, expected: int,
                    m: dict[str, Any], keys: set[str]) -> None:
    """Decode every sample of one shard; labels in range, keys unique, count as listed."""
    num_classes = len(m["class_names"])
    count = 0
    for record in records:
        key, image, label = decode_record(record, m["mode"])
        if not -1 <= label < num_classes:
            raise ShardError(f"{where}: sample '{key}' label {label} outside "
                             f"-1..{num_classes - 1}")
        if key in keys:
            raise ShardError(f"{where}: duplicate key '{key}'")
        keys.add(key)
        count += 1
    if count != expected:
        raise ShardError(f"{where}: {count} samples, manifest says {expected}")


def _verify_url(directory: ShardURL, m: dict[str, Any]) -> dict[str, Any]:
    keys: set[str] = set()
    for s in m["shards"]:
        url = directory / s["name"]
        _verify_samples(iter_shard(url, expect=(s["bytes"], s["sha256"])), url,
                        s["num_samples"], m, keys)
    return {"dir": str(directory), "split": m["split"], "source": m["source"],
            "num_shards": len(m["shards"]), "num_samples": m["num_samples"],
            "bytes": sum(s["bytes"] for s in m["shards"])}


def verify_main(directory: str | Path) -> int:
    """CLI hook for ``python -m pipeline verify-shards DIR``.

    ``DIR`` is a split directory (holding ``manifest.json``) or the shards root holding split
    sub-directories; every split found is verified.

    Args:
        directory: the directory to verify.

    Returns:
        Exit code: 0 all good, 1 a problem (printed to stderr).
    """
    if isinstance(shards_location(directory), ShardURL):
        return _verify_url_main(shards_location(directory))
    directory = Path(directory)
    if (directory / MANIFEST_NAME).is_file():
        dirs = [directory]
    else:
        dirs = [d for d in sorted(directory.iterdir()) if (d / MANIFEST_NAME).is_file()] \
            if directory.is_dir() else []
    if not dirs:
        print(f"error: verify-shards: {directory}: no {MANIFEST_NAME} here or in its "
              "sub-directories", file=sys.stderr)
        return 1
    try:
        for d in dirs:
            r = verify_shards(d)
            print(f"ok  {r['dir']}: {r['split']} ({r['source']}), {r['num_samples']} samples "
                  f"in {r['num_shards']} shard(s), {r['bytes'] / 1e6:.1f} MB")
    except (ShardError, OSError) as e:
        print(f"error: verify-shards: {e}; rebuild with `dvc repro -f build_shards`",
              file=sys.stderr)
        return 1
    return 0


def _verify_url_main(base: ShardURL) -> int:
    """``verify-shards URL``: the URL of a split, else of a shards root with the three splits."""
    try:
        try:
            read_manifest(base)
            dirs = [base]
        except ShardError:
            dirs = [base / split for split in SPLITS]
        for d in dirs:
            r = verify_shards(d)
            print(f"ok  {r['dir']}: {r['split']} ({r['source']}), {r['num_samples']} samples "
                  f"in {r['num_shards']} shard(s), {r['bytes'] / 1e6:.1f} MB")
    except ShardError as e:
        print(f"error: verify-shards: {e}", file=sys.stderr)
        return 1
    return 0
