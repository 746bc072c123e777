"""Existing WebDataset shards (img2dataset's layout): where they are and what a sample holds.

A shard set is one string (``data.pretrain_shards``, or ``data.root`` of the ``webdataset``
source), expanded by :func:`expand_shards`:

* braces first, with `braceexpand <https://github.com/trendels/braceexpand>`_ (a webdataset
  dependency): ``https://host/data-{000000..000123}.tar``, ``{a,b}``; order as written;
* then each result: a local directory gives its ``*.tar`` files (not recursive); a local glob
  (``*``, ``?``, ``[``; ``**`` recurses) its matches; a URL of a directory (no ``.tar`` at the
  end) or with glob characters is listed with `fsspec <https://filesystem-spec.readthedocs.io>`_
  (``s3://`` needs ``s3fs``, ``gs://`` ``gcsfs``; ``http(s)://`` parses the links of the
  directory's index page, as ``python -m http.server`` serves it); anything else is one shard.
  Listings and globs are sorted.

A sample (:func:`image_member`) is the tar members sharing a key: its image is the first of
``.jpg .jpeg .png .webp`` present (any case), its label (:func:`sample_label`, only for the
``webdataset`` source) the ``.cls`` member or a field of the ``.json`` member. Every other
member (``.txt`` captions, ``.json`` metadata, even a ``.pyd`` pickle) is ignored: nothing but
the image, the ``.cls`` text and the ``.json`` text is ever decoded, and nothing is unpickled.

:func:`shard_stat` gives a shard's byte size and a change detector: the ETag (or Content-MD5,
Digest, Last-Modified, for http what DVC's own URL dependencies use) of a remote object, the
mtime of a local file. The index (:mod:`pipeline.data.index`) re-reads a shard only when they
change. Its HEADs, like listings and reads, are retried after a transient failure (a 503, a
refused connection, a timeout; :func:`pipeline.data.remote.retry_transient`).
"""

from __future__ import annotations

import glob
import io
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from pipeline.data import remote
from pipeline.data.remote import RemoteError, is_transient, is_url, retry_transient
from pipeline.errors import InputError

IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp")
EXIF_ORIENTATION = 0x0112  # the EXIF/TIFF Orientation tag
SWAPS_SIDES = (5, 6, 7, 8)  # orientations that turn the image by 90 degrees (W and H swap)
LABEL_MEMBER = "cls"
_GLOB_CHARS = ("*", "?", "[")
# info() keys that change with an object's content, in order of preference (fsspec's http
# implementation copies ETag / Content-MD5 / Digest / Last-Modified from the HEAD response)
_VALIDATOR_KEYS = ("ETag", "etag", "Content-MD5", "md5Hash", "Digest", "Last-Modified",
                   "LastModified", "last_modified", "updated", "mtime")
STAT_THREADS = 16  # concurrent HEAD / stat requests


def _brace_expand(spec: str) -> list[str]:
    from braceexpand import braceexpand

    try:
        return list(braceexpand(spec))
    except Exception as e:  # noqa: BLE001 (braceexpand raises plain exceptions on bad ranges)
        raise InputError(f"{spec!r}: bad brace expression ({e})") from None


def _list_url(url: str) -> list[str]:
    import fsspec

    def listing() -> list[str]:
        if any(c in path for c in _GLOB_CHARS):
            found = fs.glob(path)
        else:
            found = [p for p in fs.find(path, maxdepth=1) if p.endswith(".tar")]
        if not found:  # fsspec's http find returns [] for a server that does not answer
            fs.info(path)
        return found

    try:
        fs, path = fsspec.core.url_to_fs(url)
        found = retry_transient(listing)
    except FileNotFoundError as e:
        raise _missing(url, e) from None
    except (ImportError, ValueError, OSError) as e:  # no backend, bad URL, unreachable
        raise RemoteError(f"{url}: cannot list ({type(e).__name__}: {e})") from None
    return sorted(fs.unstrip_protocol(p) if not is_url(p) else p for p in found)


def expand_shards(spec: str, *, key: str) -> list[str]:
    """The shard paths/URLs a shard-set string names, in order, without duplicates.

    Args:
        spec: the string (see the module docstring).
        key: the param it comes from, for messages (``data.pretrain_shards``).

    Returns:
        Local paths (as written, relative paths stay relative) and URLs.

    Raises:
        ValueError: a malformed brace expression, or nothing found (names ``key`` and ``spec``).
        RemoteError: a URL that cannot be listed.
    """
    out: list[str] = []
    for item in _brace_expand(spec.strip()):
        if is_url(item):
            tail = item.rsplit("/", 1)[-1]
            listed = any(c in item.split("://", 1)[1] for c in _GLOB_CHARS) or "." not in tail
            out += _list_url(item) if listed else [item]
        elif any(c in item for c in _GLOB_CHARS):
            out += sorted(glob.glob(item, recursive=True))
        elif os.path.isdir(item):
            out += sorted(os.path.join(item, f) for f in os.listdir(item) if f.endswith(".tar"))
        else:
            out.append(item)
    unique = list(dict.fromkeys(out))
    if not unique:
        raise InputError(f"{key} = {spec!r}: no shards found")
    return unique


def _missing(location: str, e: FileNotFoundError) -> RemoteError:
    """"not found", or the real failure fsspec's http ``info`` turned into FileNotFoundError.

    fsspec raises FileNotFoundError for any failure of its HEAD and GET (a refused connection
    included), chaining the cause: only a missing cause or an HTTP 404 means "not found".
    """
    cause = e.__cause__
    if cause is None or getattr(cause, "status", None) == 404:
        return RemoteError(f"{location}: not found")
    tail = f"; gave up after {remote.RETRIES + 1} attempts" if is_transient(e) else ""
    return RemoteError(f"{location}: cannot reach it ({type(cause).__name__}: {cause}{tail})")


def _stat_one(location: str) -> tuple[int, str]:
    if not is_url(location):
        try:
            st = os.stat(location)
        except OSError as e:
            raise RemoteError(f"{location}: {type(e).__name__}: {e.strerror}") from None
        return st.st_size, f"mtime_ns:{st.st_mtime_ns}"
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(location)
        info = retry_transient(lambda: fs.info(path))
    except FileNotFoundError as e:
        raise _missing(location, e) from None
    except Exception as e:  # noqa: BLE001 (aiohttp / botocore raise their own types)
        tail = f" (gave up after {remote.RETRIES + 1} attempts)" if is_transient(e) else ""
        raise RemoteError(f"{location}: {type(e).__name__}: {e}{tail}") from None
    size = info.get("size")
    if not isinstance(size, int):
        raise RemoteError(f"{location}: the server reports no size")
    validator = next((f"{k}:{info[k]}" for k in _VALIDATOR_KEYS if info.get(k)), "")
    return size, validator


def shard_stat(locations: list[str]) -> list[tuple[int, str]]:
    """``(bytes, change detector)`` of each shard, asked concurrently (HEAD / stat).

    The detector is ``"ETag:<value>"`` (or another of the server's validators) for a URL,
    ``"mtime_ns:<n>"`` for a local file, ``""`` when the server gives none (the shard is then
    read again every time).

    Raises:
        RemoteError: a shard is missing or its server fails (one line naming it).
    """
    with ThreadPoolExecutor(max_workers=min(STAT_THREADS, max(1, len(locations)))) as pool:
        return list(pool.map(_stat_one, locations))


def _member(record: dict[str, Any], names: tuple[str, ...]) -> str | None:
    lower = {k.lower(): k for k in record if not k.startswith("__")}
    return next((lower[n] for n in names if n in lower), None)


def image_member(record: dict[str, Any]) -> bytes | None:
    """The encoded image of a raw sample (first of :data:`IMAGE_MEMBERS`), or None."""
    name = _member(record, IMAGE_MEMBERS)
    return None if name is None else record[name]


def sample_label(record: dict[str, Any], field: str) -> int | str | None:
    """A raw sample's label: the ``.cls`` member (``field == "cls"``) or ``.json[field]``.

    The one reading of a label: the index (before ``build_shards``) and the build both call it.

    Returns:
        An int ``>= -1`` (``.cls`` text, or a JSON integer; ``-1`` = unlabelled), a str (a JSON
        string), or None when the sample has no such member or field (an unlabelled sample).

    Raises:
        ValueError: the member is there but not an integer / the JSON does not parse / the
            field is neither an integer nor a string / an integer below -1; one line naming
            the sample's key and ``data.label_field``.
    """
    where = f"sample '{record.get('__key__')}'"
    param = f"data.label_field {field!r}"
    if field == LABEL_MEMBER:
        name = _member(record, (LABEL_MEMBER,))
        if name is None:
            return None
        try:
            value: int | str = int(record[name].decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise InputError(f"{where}: .cls is not an integer ({param})") from None
    else:
        name = _member(record, ("json",))
        if name is None:
            return None
        try:
            meta = json.loads(record[name].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(f"{where}: .json does not parse ({e}; {param})") from None
        found = meta.get(field) if isinstance(meta, dict) else None
        if found is None:
            return None
        if isinstance(found, bool) or not isinstance(found, int | str):
            raise InputError(f"{where}: .json field {field!r} is {found!r}, not an integer or "
                             f"a string ({param})")
        value = found
    if isinstance(value, int) and value < -1:
        raise InputError(f"{where}: label {value} is below -1 (-1 = unlabelled; {param})")
    return value


def orientation(image: Image.Image) -> int:
    """The EXIF orientation (1..8) of an opened image, from its header; 1 when there is none.

    Values outside 1..8 count as 1, as ``ImageOps.exif_transpose`` ignores them. A PNG's
    ``eXIf`` chunk written after the pixels (the PNG spec puts it before) is read only once
    the image is loaded: for PNG only the header's is used, since PIL's PNG ``getexif`` would
    decode the pixels to find a late one.
    """
    exif = Image.Image.getexif(image) if image.format == "PNG" else image.getexif()
    value = exif.get(EXIF_ORIENTATION, 1)
    return value if value in range(1, 9) else 1


def upright_size(image: Image.Image) -> tuple[int, int]:
    """``(W, H)`` of an opened image as displayed, from its header (:func:`orientation`).

    Swapped when the EXIF orientation turns the image by 90 degrees (tags 5-8).
    """
    w, h = image.size
    return (h, w) if orientation(image) in SWAPS_SIDES else (w, h)


def open_image(data: bytes, *, reduce: Callable[[Image.Image], int] | None = None
               ) -> Image.Image:
    """Decode encoded image bytes with PIL, upright: completely, or a JPEG at a reduced scale.

    Every PIL decode of the pipeline goes through here: image files (the folder sources), shard
    members (the loaders, ``verify-shards``, the report), shards read in place (the index, the
    ``webdataset`` source). The one other decoder is torchvision's, for JPEG members whose
    views the loader cuts (:func:`pipeline.data.jpeg.decode_jpeg_bytes`), which turns them by
    the same rule.

    The image is turned as its EXIF ``Orientation`` says (``ImageOps.exif_transpose``, in
    place, after the decode: a JPEG keeps its bytes, and its tag, in the shards), so every
    reader sees what a viewer shows; tags 5-8 swap width and height (:func:`upright_size`).
    Only a turned image costs a second copy of its pixels, for the moment of the turn.

    Args:
        data: the encoded image (a shard member, a file's bytes).
        reduce: called with the opened, not yet decoded image (its header: raw size, mode,
            format); returns ``k`` in 1, 2, 4, 8. A JPEG is then decoded at 1/k of its size
            (PIL ``draft``, libjpeg's scaled inverse DCT: ``ceil(W / k) x ceil(H / k)`` px,
            before the turn); other formats always decode at full size. None = full size.

    Raises:
        UnidentifiedImageError: no PIL decoder recognises the bytes (the message names no
            in-memory buffer, so it reads well after a shard and sample name).
        OSError: truncated or corrupt data (PIL's own message).
        SyntaxError: an EXIF block that does not parse (PIL's own message).
    """
    try:
        im = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:  # PIL's message ends in "<_io.BytesIO object at 0x...>"
        raise UnidentifiedImageError(f"cannot identify the image ({len(data)} bytes, no PIL "
                                     "decoder recognises them)") from None
    if reduce is not None:
        k = reduce(im)
        if k > 1 and im.format == "JPEG":  # draft picks exactly k for (W//k, H//k) when both
            # are >= 1; an image under k px a side gets the largest reduction it allows
            im.draft(im.mode, (max(1, im.size[0] // k), max(1, im.size[1] // k)))
    im.load()
    ImageOps.exif_transpose(im, in_place=True)
    return im
