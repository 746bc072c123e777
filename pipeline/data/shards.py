"""The shard format: manifest, reading, decoding and verification of WebDataset shards.

A split directory holds ``shard-000000.tar``, ``shard-000001.tar``, ... and ``manifest.json``.
Each sample is two tar members: the image, ``<key>.png`` (lossless PNG, encoded by PIL with
fixed options and no metadata) or ``<key>.jpg`` (a source JPEG's own bytes, or a JPEG encoded at
quality 95; ``data.shard_format``), and ``<key>.cls`` (the integer label as ASCII text, ``-1`` =
unlabelled). :mod:`pipeline.data.build` writes them; this module reads them.

The manifest (``manifest.json``: the shards in order with their sample count, bytes and sha256,
the class names, image mode and shape, and the normalisation the loaders use) is the typed
:class:`~pipeline.data.manifest.Manifest` of :mod:`pipeline.data.manifest`, its one reader
and writer; :func:`read_manifest` and :class:`ShardError` are imported from there.
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from pipeline.data.manifest import (
    LAYOUT_OWN,
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    ShardError,
    read_manifest,
)
from pipeline.data.remote import RemoteError, ShardURL, open_stream, shards_location

SHARD_PATTERN = "shard-%06d.tar"
KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,90}$")
IMAGE_EXTS = ("png", "jpg", "jpeg")
LABEL_EXT = "cls"
# members that would need unpickling (or are otherwise unknown) are refused by the readers
_PICKLE_EXTS = ("pyd", "pickle", "pkl", "pth", "pt", "npy", "npz")


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



@dataclass(frozen=True)
class ImageSpec:
    """The image geometry and normalisation a split's manifest prescribes.

    Attributes:
        channels: C, 1 (``L``) or 3 (``RGB``).
        size: side in px of the square training crop and of the evaluation image.
        mean: per-channel normalisation mean, 0..1 scale.
        std: per-channel normalisation std.
        variable: the shards hold whole images of varying size (``data.max_side``): the
            training crop runs per image in the loader workers, and evaluation resizes and
            centre-crops to ``size``.
    """

    channels: int
    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    variable: bool = False


def require_images(manifest: Manifest, where: Path | ShardURL | str) -> None:
    """Refuse a split without images (``data.source: none`` builds no train or test images).

    Raises:
        ShardError: the split is empty; the message says what the evaluation stages need.
    """
    if not manifest.num_samples:
        raise ShardError(f"{where}: no images in this split (data.source "
                         f"{manifest.source}): the evaluation stages need a labelled source "
                         "with train and test images (docs/data.md, no labels at all)")


def missing_labels(shards_dir: Path | ShardURL) -> str | None:
    """Why there is nothing to evaluate with labels, or None: train and test hold images.

    Returns:
        ``"no labelled train or test images (data.source none)"`` (the empty splits and the
        source named), or None.

    Raises:
        ShardError: a split's manifest is missing or invalid.
    """
    manifests = {s: read_manifest(shards_dir / s) for s in ("train", "test")}
    empty = [s for s, m in manifests.items() if not m.num_samples]
    if not empty:
        return None
    return (f"no labelled {' or '.join(empty)} images (data.source "
            f"{manifests[empty[0]].source})")


def image_spec(manifest: Manifest, where: Path | ShardURL | str) -> ImageSpec:
    """The :class:`ImageSpec` of a split, from its manifest (:func:`read_manifest`).

    Shards of one square size train and evaluate at that size. Shards built with
    ``data.max_side`` keep whole images of varying size (or all of one size that is not
    square: photos of one camera); they use the build's ``image_size``.

    Raises:
        ShardError: no images (:func:`require_images`), or images neither all one square size
            nor built with ``max_side`` (names the manifest).
    """
    require_images(manifest, where)
    shape = manifest.image_shape
    build = manifest.settings
    mean, std = manifest.mean, manifest.std
    whole = (build.get("max_side") or build.get("variable")) and build.get("image_size")
    if whole and (not shape or shape[1] != shape[2]):  # mixed sizes, or one non-square size
        return ImageSpec(len(mean), int(build["image_size"]), mean, std, variable=True)
    if not shape or shape[1] != shape[2]:
        shown = list(shape) if shape else shape  # as the JSON reads: [3, 375, 500]
        raise ShardError(f"{where}/{MANIFEST_NAME}: images are not all the same square size "
                         f"({shown}); set data.image_size to resize them when sharding")
    return ImageSpec(int(shape[0]), int(shape[1]), mean, std)


def shard_location(directory: Path | ShardURL, entry: ShardEntry) -> str:
    """Where a manifest's shard entry lives: its ``url``, else ``directory / name``."""
    return entry.url if entry.url is not None else str(directory / str(entry.name))


def iter_shard(path: str | Path | ShardURL, *, expect: tuple[int, str] | None = None,
               digest: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Yield the raw samples (``{"__key__", "__url__", ext: bytes}``) of one shard.

    A URL is streamed (:func:`pipeline.data.remote.open_stream`: retries with backoff) and
    hashed as it is read; with ``expect`` the byte count and sha256 are compared with the
    manifest once the stream is exhausted, so the error comes after the shard's samples (a
    caller that stops early skips the check). Local files are read as they are (callers check
    them beforehand, see ``pipeline.data.loader``).

    Args:
        path: a local shard file or a shard URL.
        expect: ``(bytes, sha256)`` from the manifest, checked at the end of a URL.
        digest: for a URL, filled with ``bytes`` and ``sha256`` of the whole stream once it is
            exhausted (the index records them without reading the shard twice).

    Raises:
        ShardError: the tar cannot be read, the URL failed, or ``expect`` differs (names the
            shard).
    """
    if isinstance(path, ShardURL) or (isinstance(path, str) and isinstance(
            shards_location(path), ShardURL)):
        yield from _iter_url_shard(str(path), expect, digest)
        return
    try:
        # here: importing webdataset imports torch (seconds), needless for the manifests alone
        # (the index stage with nothing to index, verify-shards' listing)
        from webdataset.tariterators import tar_file_expander, url_opener

        files = tar_file_expander(url_opener([{"url": str(path)}]))
        yield from group_samples(files, str(path))
    except ShardError:
        raise
    except Exception as e:  # tarfile / gopen errors
        raise ShardError(f"{path}: unreadable shard ({type(e).__name__}: {e})") from None


def sample_key_at(directory: Path, n: int, samples_per_shard: int) -> str:
    """The key of sample ``n`` of a split's shards in ``directory`` (``samples_per_shard`` each).

    A sample's members are adjacent, in ascending extension order: a new sample starts where
    the key changes or the extension does not ascend (two samples with one key, side by side).
    """
    keys: list[str] = []
    last: tuple[str | None, str | None] = (None, None)
    with tarfile.open(directory / (SHARD_PATTERN % (n // samples_per_shard))) as tar:
        for m in tar:
            key, ext = member_key(m.name)
            if key != last[0] or (ext or "") <= (last[1] or ""):
                keys.append(str(key))
            last = (key, ext)
    return keys[n % samples_per_shard]


def member_key(name: str) -> tuple[str | None, str | None]:
    """A tar member name as ``(sample key, extension)``: the key ends at the LAST dot.

    img2dataset writes ``<key>.<ext>`` with one-part extensions, and a key may hold dots
    (``photo.2024.jpg`` is sample ``photo.2024``). WebDataset's own rule
    (``webdataset.tariterators.base_plus_ext``) ends the key at the FIRST dot of the base
    name instead, which merges ``a.b.c.jpg``, ``a.b.c.json`` and ``a.b.d.jpg`` into one sample
    ``a`` whose members ``b.c.jpg``, ``b.d.jpg`` are no image. Both rules agree on names with
    one dot (our own shards: :data:`KEY_RE` has none; img2dataset's numeric keys). A name
    with two readings in one shard (``k.jpg`` beside ``k.seg.png``) is refused by
    :func:`group_samples`. Every reader (index, build, loaders, verify) splits names here.

    Returns:
        ``(key, extension)``; ``(None, None)`` for a name without an extension or whose base
        name starts with a dot (skipped, as WebDataset skips them).
    """
    head, sep, base = name.rpartition("/")
    stem, dot, ext = base.rpartition(".")
    if not dot or not stem or stem.startswith(".") or not ext:
        return None, None
    return head + sep + stem, ext


def group_samples(files: Iterable[dict[str, Any]], where: str) -> Iterator[dict[str, Any]]:
    """WebDataset's member grouping with :func:`member_key`, refusing ambiguous names.

    Args:
        files: ``{"fname", "data", "__url__"}`` per tar member, in tar order
            (``webdataset.tariterators.tar_file_expander``).
        where: the shard, for messages.

    Yields:
        Raw samples ``{"__key__", "__url__", ext: bytes}``.

    Raises:
        ShardError: a key that is another key of the shard plus a dotted part (``k`` and
            ``k.seg`` from ``k.jpg`` and ``k.seg.png``): WebDataset would read ``seg.png`` as
            a member of sample ``k``, :func:`member_key` a sample of its own; naming both keys.
    """
    from webdataset.tariterators import group_by_keys

    keys: set[str] = set()
    parents: dict[str, str] = {}  # "k" -> "k.seg": keys one dotted part longer
    for record in group_by_keys(files, keys=member_key):
        key = record["__key__"]
        parent = key.rpartition(".")[0] if "." in key.rpartition("/")[2] else None
        clash = (parent, key) if parent in keys else (key, parents.get(key)) if (
            key in parents) else None
        if clash is not None:
            short, long = clash
            raise ShardError(
                f"{where}: sample keys {short!r} and {long!r} read two ways: WebDataset ends a "
                f"key at the first dot (member '{long}.<ext>' of sample {short!r}), "
                "img2dataset's layout, read here, at the last (two samples); rename the "
                "members so that no key is another key plus a dotted part")
        keys.add(key)
        if parent is not None:
            parents.setdefault(parent, key)
        yield record


def _iter_url_shard(url: str, expect: tuple[int, str] | None,
                    digest: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    from webdataset.tariterators import tar_file_expander

    try:
        raw = open_stream(url)
    except RemoteError as e:
        raise ShardError(str(e)) from None
    last = None  # the last sample is yielded only once the whole shard has been checked: a
    # shard cut inside its last sample reads as a valid tar whose last sample lacks members
    with raw, io.BufferedReader(raw, buffer_size=1 << 20) as stream:
        try:
            for record in group_samples(tar_file_expander([{"url": url, "stream": stream}]),
                                        url):
                if last is not None:
                    yield last
                last = record
            while stream.read(1 << 20):  # tar end padding: hash every byte
                pass
        except ShardError:  # keys read two ways (group_samples): already one line
            raise
        except RemoteError as e:
            raise ShardError(str(e)) from None
        except Exception as e:  # noqa: BLE001 (tarfile errors, wrapped by webdataset)
            if isinstance(e.__context__, RemoteError):
                raise ShardError(str(e.__context__)) from None
            why = str(e.args[0]).split(" @ ")[0] if e.args else ""
            raise ShardError(f"{url}: unreadable shard at byte {raw.pos} "
                             f"({type(e).__name__}: {why}); truncated or corrupt") from None
    if digest is not None:
        digest.update(bytes=raw.pos, sha256=raw.sha256.hexdigest())
    if expect is not None:
        nbytes, sha = expect
        if raw.pos != nbytes:
            raise ShardError(f"{url}: {raw.pos} bytes, manifest says {nbytes} (truncated or "
                             "altered)")
        digest = raw.sha256.hexdigest()
        if digest != sha:
            raise ShardError(f"{url}: sha256 {digest[:16]}... != manifest {sha[:16]}... "
                             "(altered)")
    if last is not None:
        yield last


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


def decode_record(record: dict[str, Any], mode: str, *,
                  reduce: Callable[[Image.Image], int] | None = None
                  ) -> tuple[str, Image.Image, int]:
    """Decode a raw sample with PIL (never unpickling).

    Args:
        record: a raw WebDataset sample.
        mode: the manifest's image mode; other modes are converted to it.
        reduce: a JPEG member's DCT reduction, chosen from its header
            (:func:`pipeline.data.external.open_image`); None = full size.

    Returns:
        ``(key, image, label)``.

    Raises:
        ShardError: disallowed members, an undecodable image or a non-integer label.
    """
    check_members(record)
    where = f"{record.get('__url__')}: sample '{record.get('__key__')}'"
    data = next(record[e] for e in IMAGE_EXTS if e in record)
    from pipeline.data.external import open_image

    try:
        with open_image(data, reduce=reduce) as im:
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
    if any(s.url is not None for s in m.shards):
        return _verify_entries(directory, m)
    listed = [str(s.name) for s in m.shards]
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
    for s in m.shards:
        path = directory / str(s.name)
        size = path.stat().st_size
        if size != s.bytes:
            raise ShardError(f"{path}: {size} bytes, manifest says {s.bytes} (truncated or "
                             "altered)")
        digest = sha256_file(path)
        if digest != s.sha256:
            raise ShardError(f"{path}: sha256 {digest} != manifest {s.sha256} (altered)")
        _verify_samples(iter_shard(path), path, s.num_samples, m, keys)
    return _summary(directory, m)


def _summary(directory: Path | ShardURL, m: Manifest) -> dict[str, Any]:
    """:func:`verify_shards`' answer."""
    return {"dir": str(directory), "split": m.split, "source": m.source,
            "num_shards": len(m.shards), "num_samples": m.num_samples,
            "bytes": sum(s.bytes for s in m.shards)}


def _verify_samples(records: Iterator[dict[str, Any]], where: Path | ShardURL, expected: int,
                    m: Manifest, keys: set[str]) -> None:
    """Decode every sample of one shard; labels in range, keys unique, count as listed."""
    num_classes = len(m.class_names)
    count = 0
    for record in records:
        key, image, label = decode_record(record, m.mode)
        if not -1 <= label < num_classes:
            raise ShardError(f"{where}: sample '{key}' label {label} outside "
                             f"-1..{num_classes - 1}")
        if key in keys:
            raise ShardError(f"{where}: duplicate key '{key}'")
        keys.add(key)
        count += 1
    if count != expected:
        raise ShardError(f"{where}: {count} samples, manifest says {expected}")


def _verify_entries(directory: Path | ShardURL, m: Manifest) -> dict[str, Any]:
    """An index manifest: every listed shard (paths or URLs) against its size and sha256."""
    from pipeline.data.external import image_member, open_image

    for s in m.shards:
        where = shard_location(directory, s)
        if s.read_layout == LAYOUT_OWN:
            _verify_samples(_checked_records(where, s), where, s.num_samples, m, set())
            continue
        broken = {b.key for b in s.broken or ()}
        count = 0
        for record in _checked_records(where, s):
            if record["__key__"] in broken:
                continue
            data = image_member(record)
            try:
                open_image(data if data is not None else b"")
            except Exception as e:  # noqa: BLE001 (PIL raises several types)
                raise ShardError(f"{where}: sample '{record['__key__']}' undecodable "
                                 f"({type(e).__name__}) but not listed as broken") from None
            count += 1
        if count != s.num_samples:
            raise ShardError(f"{where}: {count} samples, manifest says {s.num_samples}")
    return _summary(directory, m)


def _checked_records(where: str, s: ShardEntry) -> Iterator[dict[str, Any]]:
    """The raw samples of a listed shard, its bytes and sha256 checked (URLs while streaming)."""
    if isinstance(shards_location(where), ShardURL):
        return iter_shard(where, expect=(s.bytes, s.sha256))
    path = Path(where)
    if not path.is_file():
        raise ShardError(f"{path}: shard listed in the manifest is missing")
    if path.stat().st_size != s.bytes or sha256_file(path) != s.sha256:
        raise ShardError(f"{path}: size or sha256 differs from the manifest (altered; rerun "
                         "`dvc repro` to index it again)")
    return iter_shard(path)


def _verify_url(directory: ShardURL, m: Manifest) -> dict[str, Any]:
    keys: set[str] = set()
    for s in m.shards:
        url = directory / str(s.name)
        _verify_samples(iter_shard(url, expect=(s.bytes, s.sha256)), url, s.num_samples, m,
                        keys)
    return _summary(directory, m)
