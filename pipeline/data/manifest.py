"""A split's ``manifest.json`` as one typed object: :class:`Manifest`, one reader, one writer.

The file (format ``moco-pipeline-shards/1``) lists a split's shards in storage order with their
sample count, byte size and sha256, plus the class names, image mode and shape, and the
normalisation ``mean``/``std`` the loaders use. A split may be empty (``num_samples`` 0, no
shards: ``data.source: none`` has no train/test images). A shard entry names a file of the
split directory (``name``) or, in the index of existing WebDataset shards
(:mod:`pipeline.data.index`), gives its own location (``url``: a path or URL) and ``layout:
"webdataset"``: img2dataset-style samples whose image is read and every other member ignored,
minus the ``broken`` keys the index found undecodable.

:func:`read_manifest` is the only reader (it validates, and names the file in every error);
:meth:`Manifest.to_json` the only serialisation (``json.dumps(indent=2, sort_keys=True)`` plus a
newline) and :func:`write_manifest` the only writer. A manifest read and written again is
byte-identical: a key a file lacks stays absent (the optional fields are None), and keys this
version does not know are kept in ``extra``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.atomic import write_atomic
from pipeline.data.remote import RemoteError, ShardURL, read_url, shards_location
from pipeline.errors import PipelineError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "moco-pipeline-shards/1"
SHARD_NAME_RE = re.compile(r"^shard-\d{6}\.tar$")
LAYOUT_OWN, LAYOUT_WEBDATASET = "pipeline", "webdataset"  # shard entry ``layout``
CHANNELS = {"L": 1, "RGB": 3}


class ShardError(PipelineError):
    """Shards or a manifest that are missing, inconsistent or corrupt (message names the path)."""


def round6(xs: Any) -> tuple[float, ...]:
    """Per-channel statistics as the manifests record them: floats rounded to 6 decimals."""
    return tuple(round(float(x), 6) for x in xs)


_VALUES = np.arange(256, dtype=np.uint64)


def pixel_sums(image: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """Exact per-channel sums of an 8-bit image's values and of their squares, and its pixels.

    From PIL's histogram (``(C * 256,)`` counts): no copy of the pixels is made, so a 60 MP
    photo costs no more memory than its decoded image (squaring it as ``uint64`` took 1.4 GB).

    Args:
        image: a loaded PIL image in ``L`` or ``RGB``.

    Returns:
        ``(sums, squares, pixels)``: ``(C,)`` uint64 sums of the 0..255 values and of their
        squares, and the pixels per channel (:func:`pixel_stats` takes them).
    """
    hist = np.asarray(image.histogram(), np.uint64).reshape(-1, 256)
    return hist @ _VALUES, hist @ _VALUES**2, int(hist[0].sum())


def pixel_stats(pix_sum: Any, pix_sq: Any, n_pix: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel pixel mean and std on the 0..1 scale from exact integer sums.

    Args:
        pix_sum: ``(C,)`` sums of the 0..255 pixel values.
        pix_sq: ``(C,)`` sums of their squares.
        n_pix: pixels per channel (0 gives zeros).

    Returns:
        ``(mean, std)``, each ``(C,)`` float64 (unrounded; :func:`round6` for the manifest).
    """
    n = max(n_pix, 1)
    mean = np.asarray(pix_sum, np.float64) / (255.0 * n)
    var = np.asarray(pix_sq, np.float64) / (255.0**2 * n) - mean**2
    return mean, np.sqrt(np.maximum(var, 0.0))


@dataclass(frozen=True)
class BrokenSample:
    """A sample of an indexed shard that the index could not decode (left out when read)."""

    key: str
    why: str


@dataclass(frozen=True)
class ShardStats:
    """What the index sums per shard (its decodable samples) into the set's manifest.

    Attributes:
        grey: every image is grey (the set trains in ``L`` when all are).
        image_wh: ``(W, H)`` in px when all images have one size, else None.
        pixels: pixels per channel.
        pixel_sum: ``(3,)`` exact sums of the RGB values 0..255.
        pixel_sq: ``(3,)`` exact sums of their squares.
    """

    grey: bool
    image_wh: tuple[int, int] | None
    pixels: int
    pixel_sum: tuple[int, ...]
    pixel_sq: tuple[int, ...]


@dataclass(frozen=True)
class LabelSummary:
    """One indexed shard's labels (:func:`pipeline.data.index.label_summary`).

    Attributes:
        kind: ``"int"``, ``"str"``, or None when no sample is labelled.
        counts: ``{class: samples}``; an integer label's class is its decimal text.
        unlabelled: samples without a label (or ``-1``).
        first: ``(key, label)`` of the first labelled sample (messages name it), or None.
    """

    kind: str | None
    counts: Mapping[str, int]
    unlabelled: int
    first: tuple[str, int | str] | None


_ENTRY_KEYS = ("name", "url", "layout", "num_samples", "bytes", "sha256", "broken", "labels")
_STATS_KEYS = ("grey", "image_wh", "pixels", "pixel_sum", "pixel_sq")


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a manifest, in storage order.

    Attributes:
        num_samples: samples read from the shard (an indexed shard: its decodable ones).
        bytes: the shard's size in bytes.
        sha256: hex sha256 of its bytes.
        name: ``shard-NNNNNN.tar`` in the split directory (our own shards), else None.
        url: the shard's own location, a path or URL (shards read in place), else None.
        layout: ``"pipeline"`` (our members) or ``"webdataset"`` (img2dataset-style); None
            when the file does not say (then ``"pipeline"``, :attr:`read_layout`).
        broken: an indexed shard's undecodable samples; None for our own shards.
        stats: an indexed shard's pixel statistics; None for our own shards.
        labels: an indexed labelled shard's label summary, else None.
        extra: keys this version does not know, written back unchanged.
    """

    num_samples: int
    bytes: int
    sha256: str
    name: str | None = None
    url: str | None = None
    layout: str | None = None
    broken: tuple[BrokenSample, ...] | None = None
    stats: ShardStats | None = None
    labels: LabelSummary | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def read_layout(self) -> str:
        """How the shard's samples are read: :attr:`layout`, ``"pipeline"`` when unset."""
        return self.layout or LAYOUT_OWN

    @classmethod
    def from_dict(cls, s: Mapping[str, Any]) -> ShardEntry:
        """An entry from its JSON object (validated by :func:`read_manifest` beforehand).

        Raises:
            KeyError, TypeError, ValueError: ``broken``, ``labels`` or the statistics malformed.
        """
        stats = (ShardStats(bool(s["grey"]), _tuple_or_none(s["image_wh"]), s["pixels"],
                            tuple(s["pixel_sum"]), tuple(s["pixel_sq"]))
                 if all(k in s for k in _STATS_KEYS) else None)
        lab = s.get("labels")
        labels = None if lab is None else LabelSummary(
            lab["kind"], dict(lab["counts"]), lab["unlabelled"], _tuple_or_none(lab["first"]))
        broken = None if "broken" not in s else tuple(
            BrokenSample(b["key"], b["why"]) for b in s["broken"])
        known = _ENTRY_KEYS + (_STATS_KEYS if stats is not None else ())
        return cls(num_samples=s["num_samples"], bytes=s["bytes"], sha256=s["sha256"],
                   name=s.get("name"), url=s.get("url"), layout=s.get("layout"),
                   broken=broken, stats=stats, labels=labels,
                   extra={k: v for k, v in s.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        """The entry's JSON object (absent fields left out)."""
        d: dict[str, Any] = {**self.extra, "num_samples": self.num_samples,
                             "bytes": self.bytes, "sha256": self.sha256}
        for key in ("name", "url", "layout"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.broken is not None:
            d["broken"] = [{"key": b.key, "why": b.why} for b in self.broken]
        if self.stats is not None:
            st = self.stats
            d.update(grey=st.grey, image_wh=_list_or_none(st.image_wh), pixels=st.pixels,
                     pixel_sum=list(st.pixel_sum), pixel_sq=list(st.pixel_sq))
        if self.labels is not None:
            lab = self.labels
            d["labels"] = {"kind": lab.kind, "counts": dict(lab.counts),
                           "unlabelled": lab.unlabelled, "first": _list_or_none(lab.first)}
        return d


_TOP_KEYS = ("format", "source", "split", "num_samples", "mode", "class_names", "mean", "std",
             "shards", "image_shape", "samples_per_shard", "num_broken", "pixel_mean",
             "pixel_std", "label_counts", "build")


@dataclass(frozen=True)
class Manifest:
    """A split's manifest (``manifest.json``).

    Attributes:
        source: the data source (``fashion_mnist``, ``imagefolder``, ``webdataset``, ...;
            ``a+b`` for the joined pretraining set).
        split: ``pretrain``, ``train``, ``test`` (``labelled`` for an index).
        num_samples: N, the sum of the shards' ``num_samples``.
        mode: ``"L"`` or ``"RGB"``.
        class_names: the C class names (labels ``0..C-1``; ``-1`` = unlabelled).
        mean: ``(C_img,)`` normalisation mean on the 0..1 scale (empty for an empty split).
        std: ``(C_img,)`` normalisation std.
        shards: the shard entries in storage order.
        image_shape: ``(C_img, H, W)`` when every image has that shape, else None (always
            written, ``null`` when None).
        samples_per_shard: ``data.samples_per_shard`` of a build; None in an index.
        num_broken: samples the index left out as undecodable; None in a build.
        pixel_mean: ``(C_img,)`` the split's own pixel mean (0..1); None when absent.
        pixel_std: ``(C_img,)`` its pixel std; None when absent.
        label_counts: ``{label: samples}`` (label as decimal text); None when absent.
        build: the settings the split was built or joined with (``seed``, ``image_size``,
            ``max_side``, ``variable``, ``parts``, ``unlabelled``, ...); None when absent.
        extra: top-level keys this version does not know, written back unchanged.
    """

    source: str
    split: str
    num_samples: int
    mode: str
    class_names: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    shards: tuple[ShardEntry, ...]
    image_shape: tuple[int, int, int] | None = None
    samples_per_shard: int | None = None
    num_broken: int | None = None
    pixel_mean: tuple[float, ...] | None = None
    pixel_std: tuple[float, ...] | None = None
    label_counts: Mapping[str, int] | None = None
    build: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def settings(self) -> Mapping[str, Any]:
        """:attr:`build`, or an empty mapping when the manifest has none."""
        return self.build or {}

    @classmethod
    def from_dict(cls, m: Mapping[str, Any]) -> Manifest:
        """A manifest from its JSON object, validated by :func:`read_manifest` beforehand.

        Raises:
            KeyError, TypeError, ValueError: a shard entry's ``broken``, ``labels`` or
                statistics malformed (:func:`read_manifest` names the file).
        """
        def opt_tuple(key: str) -> Any:
            return tuple(m[key]) if m.get(key) is not None else None

        return cls(source=m["source"], split=m["split"], num_samples=m["num_samples"],
                   mode=m["mode"], class_names=tuple(m["class_names"]), mean=tuple(m["mean"]),
                   std=tuple(m["std"]), shards=tuple(ShardEntry.from_dict(s) for s in m["shards"]),
                   image_shape=opt_tuple("image_shape"),
                   samples_per_shard=m.get("samples_per_shard"), num_broken=m.get("num_broken"),
                   pixel_mean=opt_tuple("pixel_mean"), pixel_std=opt_tuple("pixel_std"),
                   label_counts=m.get("label_counts"), build=m.get("build"),
                   extra={k: v for k, v in m.items() if k not in _TOP_KEYS})

    def to_dict(self) -> dict[str, Any]:
        """The manifest's JSON object, as written (absent fields left out)."""
        d: dict[str, Any] = {
            **self.extra, "format": MANIFEST_FORMAT, "source": self.source, "split": self.split,
            "num_samples": self.num_samples, "mode": self.mode,
            "class_names": list(self.class_names), "mean": list(self.mean),
            "std": list(self.std), "image_shape": _list_or_none(self.image_shape),
            "shards": [s.to_dict() for s in self.shards]}
        for key in ("samples_per_shard", "num_broken", "pixel_mean", "pixel_std"):
            value = getattr(self, key)
            if value is not None:
                d[key] = list(value) if isinstance(value, tuple) else value
        if self.label_counts is not None:
            d["label_counts"] = dict(self.label_counts)
        if self.build is not None:
            d["build"] = _plain(self.build)
        return d

    def to_json(self) -> str:
        """The text of ``manifest.json``: key-sorted JSON, indent 2, a final newline."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def write_manifest(manifest: Manifest, directory: str | Path) -> Path:
    """Write ``directory/manifest.json`` (:meth:`Manifest.to_json`) atomically.

    Returns:
        The file written.

    Raises:
        OSError: the write failed (the previous file, if any, is untouched).
    """
    path = Path(directory) / MANIFEST_NAME
    text = manifest.to_json().encode()
    write_atomic(path, lambda f: f.write(text))
    return path


def read_manifest(directory: str | Path | ShardURL) -> Manifest:
    """Load and validate a split's ``manifest.json``.

    Args:
        directory: the split directory, or its URL (``https://…/pretrain``, ``s3://…``).

    Returns:
        The :class:`Manifest`; ``shards`` in storage order.

    Raises:
        ShardError: missing file, invalid JSON, or a missing/inconsistent field (names the file
            or URL).
    """
    location = shards_location(directory)
    path = location / MANIFEST_NAME
    if isinstance(path, ShardURL):
        try:
            text: str | bytes = read_url(path)
        except RemoteError as e:
            raise ShardError(f"{e} (manifest not found or unreadable)") from None
    else:
        if not path.is_file():
            raise ShardError(f"{path}: manifest not found (build the shards first)")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ShardError(f"{path}: not a readable JSON manifest ({e})") from None
    return parse_manifest(text, path)


def parse_manifest(text: str | bytes, path: Path | ShardURL) -> Manifest:
    """Validate the text of a ``manifest.json`` (:func:`read_manifest` once it has the bytes).

    Args:
        text: the file's contents.
        path: where they come from, for the messages.

    Raises:
        ShardError: invalid JSON, or a missing/inconsistent field (names ``path``).
    """
    try:
        m = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardError(f"{path}: not a readable JSON manifest ({e})") from None
    _validate(m, path)
    try:
        return Manifest.from_dict(m)
    except (KeyError, TypeError, ValueError) as e:
        raise ShardError(f"{path}: invalid manifest: a shard entry's broken, labels or "
                         f"statistics malformed ({type(e).__name__}: {e})") from None


def _validate(m: Any, path: Path | ShardURL) -> None:
    """The checks of :func:`read_manifest` on the parsed JSON (messages name ``path``)."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ShardError(f"{path}: invalid manifest: {what}")

    need(isinstance(m, dict) and m.get("format") == MANIFEST_FORMAT,
         f"'format' must be {MANIFEST_FORMAT!r}")
    for key, typ in (("source", str), ("split", str), ("num_samples", int), ("mode", str),
                     ("class_names", list), ("mean", list), ("std", list), ("shards", list)):
        need(isinstance(m.get(key), typ), f"'{key}' missing or not a {typ.__name__}")
    need(m["mode"] in CHANNELS, f"'mode' must be one of {list(CHANNELS)}")
    empty = not m["shards"]
    need(len(m["mean"]) == len(m["std"]) == CHANNELS[m["mode"]]
         or (empty and not m["mean"] and not m["std"]), "'mean'/'std' length != channels")
    need(not empty or m["num_samples"] == 0, "no shards")
    names = []
    for i, s in enumerate(m["shards"]):
        external = isinstance(s, dict) and "url" in s
        if external:
            need(isinstance(s["url"], str) and bool(s["url"])
                 and s.get("layout", LAYOUT_OWN) in (LAYOUT_OWN, LAYOUT_WEBDATASET),
                 f"shards[{i}] needs a 'url' string and a known 'layout'")
        else:
            need(isinstance(s, dict) and isinstance(s.get("name"), str)
                 and bool(SHARD_NAME_RE.match(s["name"])), f"shards[{i}].name invalid")
            names.append(s["name"])
        need(isinstance(s.get("num_samples"), int) and (s["num_samples"] > 0 or (
            external and s["num_samples"] == 0)), f"shards[{i}].num_samples must be a "
             "positive int")
        need(isinstance(s.get("bytes"), int) and isinstance(s.get("sha256"), str),
             f"shards[{i}] needs 'bytes' and 'sha256'")
    need(names == sorted(set(names)), "shard names must be unique and sorted")
    need(sum(s["num_samples"] for s in m["shards"]) == m["num_samples"],
         "'num_samples' != sum of the shards' num_samples")


def _tuple_or_none(xs: Sequence[Any] | None) -> Any:
    return tuple(xs) if xs is not None else None


def _list_or_none(xs: Sequence[Any] | None) -> list[Any] | None:
    return list(xs) if xs is not None else None


def _plain(x: Any) -> Any:
    """Mappings and tuples as JSON dicts and lists (``build`` may hold either)."""
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x
