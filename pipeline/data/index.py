"""The index of existing WebDataset shards: their identity for DVC, the loader and the resume.

Shards that others wrote (img2dataset, webdataset's ``ShardWriter``, a data team; local, http,
s3, gs) are read IN PLACE: the ``index_shards`` stage copies no image. It records, per shard,
the location, byte size, sha256 and number of decodable samples, plus the keys of the samples
it could not decode, in ``data/index/<set>/manifest.json`` (the split-manifest format of
:mod:`pipeline.data.shards`, with ``url`` shard entries and ``layout: "webdataset"``):

* ``pretrain``: ``data.pretrain_shards``, read in place by the pretraining loader, beside the
  built ``pretrain`` split (:func:`pretrain_manifest` joins the two);
* ``labelled``: ``data.root`` when ``data.source`` is ``webdataset`` (the labelled shards the
  ``build_shards`` stage turns into the evaluation splits).

That manifest is the data's identity: ``pretrain`` and ``build_shards`` depend on it in
``dvc.yaml``, and its sha256 list enters the resume fingerprint. The stage runs at every
``dvc repro`` (``always_changed``: a remote cannot be watched otherwise, see docs/data.md) and
is cheap when nothing changed: one HEAD (or stat) per shard, and a shard whose size and change
detector (ETag, Last-Modified, mtime; :func:`pipeline.data.external.shard_stat`) equal those of
the last index keeps its entry without being read. The detectors live in
``data/index/validators.json``, not in the manifests, so a re-upload of identical bytes reruns
nothing downstream. A new, changed or added shard is read once, streamed: hashed and every
image decoded, nothing stored.

Local image folders are listed by the same stage (:mod:`pipeline.data.folder_index`); the
pretraining set the params and these indexes make is planned by :mod:`pipeline.data.plan`.
The labelled source of such shards (:mod:`pipeline.data.sources.webdataset`) reads this index;
the index reads no source.

Broken images (web crawls always hold a few): a sample without an image member or whose image
does not decode is skipped and counted, up to ``data.max_broken_fraction`` of all the set's
samples; beyond that the stage stops with one line naming the shard with the most and its
first key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.atomic import read_json
from pipeline.cores import process_pool
from pipeline.data.external import (
    expand_shards,
    image_member,
    open_image,
    sample_label,
    shard_stat,
)
from pipeline.data.manifest import (
    CHANNELS,
    LAYOUT_OWN,
    LAYOUT_WEBDATASET,
    MANIFEST_NAME,
    BrokenSample,
    LabelSummary,
    Manifest,
    ShardEntry,
    ShardError,
    ShardStats,
    pixel_stats,
    pixel_sums,
    read_manifest,
    round6,
)
from pipeline.data.modes import image_kind, to_mode
from pipeline.data.remote import RemoteError, ShardURL, is_url
from pipeline.data.shards import image_spec, iter_shard, sha256_file, shard_location

log = logging.getLogger(__name__)

INDEX_DIR = Path("data/index")  # beside data/shards; the index_shards stage's outputs
VALIDATORS = INDEX_DIR / "validators.json"
SETS = ("pretrain", "labelled")
def empty_manifest(split: str) -> Manifest:
    """The manifest of a set with no shards (an empty spec)."""
    return Manifest(source="webdataset", split=split, num_samples=0, num_broken=0,
                    class_names=(), mode="L", mean=(), std=(), pixel_mean=(), pixel_std=(),
                    image_shape=None, label_counts={}, build={}, shards=())


def _read_shard(url: str, label_field: str | None = None) -> ShardEntry:
    """Stream one shard: sha256, bytes, decodable samples, broken keys, pixel statistics.

    With ``label_field`` (the labelled set) also the labels of the decodable samples
    (:func:`label_summary`, read by
    :func:`pipeline.data.external.sample_label` as the build reads them), under ``labels``.

    Raises:
        ShardError: the shard cannot be read, or (with ``label_field``) a label the build
            would refuse; names the shard and the sample.
    """
    digest: dict[str, Any] = {}
    labels: list[tuple[str, int | str | None]] = []
    local = not is_url(url)
    records: Iterator[dict[str, Any]] = iter_shard(url) if local else iter_shard(url,
                                                                             digest=digest)
    good, grey = 0, True
    broken: list[BrokenSample] = []
    sizes: set[tuple[int, int]] = set()
    pix_sum = np.zeros(3, dtype=np.uint64)
    pix_sq = np.zeros(3, dtype=np.uint64)
    n_pix = 0
    for record in records:
        key = str(record.get("__key__"))
        data = image_member(record)
        if data is None:
            members = sorted(k for k in record if not k.startswith("__"))
            broken.append(BrokenSample(key, f"no image member (has {', '.join(members)})"))
            continue
        try:
            with open_image(data) as im:
                grey = grey and image_kind(im) == "L"
                sizes.add(im.size)
                # exact sums from the histogram: ~10x faster than numpy, no copy of the pixels
                sums, squares, pixels = pixel_sums(to_mode(im, "RGB"))
        except Exception as e:  # noqa: BLE001 (PIL and the mode conversion raise many types)
            broken.append(BrokenSample(key, f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        pix_sum += sums
        pix_sq += squares
        n_pix += pixels
        good += 1
        if label_field is not None:
            try:
                labels.append((key, sample_label(record, label_field)))
            except ValueError as e:
                raise ShardError(f"{url}: {e}") from None
    if local:
        digest.update(bytes=Path(url).stat().st_size, sha256=sha256_file(url))
    (w, h), = sizes if len(sizes) == 1 else [(None, None)]
    stats = ShardStats(grey=grey, image_wh=(w, h) if w is not None else None, pixels=n_pix,
                       pixel_sum=tuple(int(x) for x in pix_sum),
                       pixel_sq=tuple(int(x) for x in pix_sq))
    return ShardEntry(url=url, layout=LAYOUT_WEBDATASET, num_samples=good,
                      bytes=digest["bytes"], sha256=digest["sha256"], broken=tuple(broken),
                      stats=stats, labels=(label_summary(labels, url, label_field)
                                           if label_field is not None else None))


def _read_shards(urls: list[str], label_field: str | None, split: str,
                 workers: int) -> dict[str, ShardEntry]:
    """:func:`_read_shard` of each URL, on up to ``workers`` processes (one shard each)."""
    t = time.monotonic()
    if workers > 1 and len(urls) > 1:
        with process_pool(min(workers, len(urls))) as pool:
            entries = list(pool.map(_read_shard, urls, [label_field] * len(urls)))
    else:
        entries = [_read_shard(url, label_field) for url in urls]
    for url, entry in zip(urls, entries):
        log.info("index %s: %s: %d samples, %d broken", split, url, entry.num_samples,
                 len(entry.broken or ()))
    if urls:
        log.info("index %s: %d shard(s) read on %d process(es) (%.1fs)", split, len(urls),
                 min(workers, len(urls)), time.monotonic() - t)
    return dict(zip(urls, entries))


def check_broken_budget(entries: Sequence[ShardEntry], max_fraction: float, key: str) -> None:
    """Stop when more than ``max_fraction`` of all samples are broken.

    Raises:
        ShardError: over the budget; one line naming the shard with the most broken samples,
            its first broken key and why, and the totals.
    """
    n_broken = sum(len(s.broken or ()) for s in entries)
    total = n_broken + sum(s.num_samples for s in entries)
    if not over_budget(n_broken, total, max_fraction):
        return
    worst = max(entries, key=lambda s: len(s.broken or ()))
    bad = worst.broken or ()
    first = bad[0]
    raise ShardError(
        f"{worst.url}: {len(bad)} of "
        f"{len(bad) + worst.num_samples} samples undecodable, first key "
        f"{first.key!r} ({first.why}); {n_broken} of {total} in {key} = "
        f"{100 * n_broken / total:.2f} % > data.max_broken_fraction {max_fraction:g} "
        f"({100 * max_fraction:g} %)")


def _assemble(entries: list[ShardEntry], *, split: str, max_fraction: float,
              label_field: str | None = None) -> Manifest:
    """The set's manifest from its shard entries (statistics summed exactly).

    The spec is not in it: the same shards spelled another way (a directory, a glob, braces)
    give the same manifest, so respelling ``data.pretrain_shards`` reruns nothing downstream.
    """
    stats = [_stats(s) for s in entries]
    grey = all(st.grey for s, st in zip(entries, stats) if s.num_samples)
    mode = "L" if grey else "RGB"
    n_pix = sum(st.pixels for st in stats)
    total = [sum(st.pixel_sum[c] for st in stats) for c in range(3)]
    sq = [sum(st.pixel_sq[c] for st in stats) for c in range(3)]
    mean, std = pixel_stats(total, sq, n_pix)
    if grey:  # three equal channels
        mean, std = mean[:1], std[:1]
    shapes = {st.image_wh for s, st in zip(entries, stats) if s.num_samples}
    shape = None
    if len(shapes) == 1 and None not in shapes:
        (w, h), = shapes
        shape = (CHANNELS[mode], h, w)
    return Manifest(source="webdataset", split=split,
                    num_samples=sum(s.num_samples for s in entries),
                    num_broken=sum(len(s.broken or ()) for s in entries), class_names=(),
                    mode=mode, mean=round6(mean), std=round6(std), pixel_mean=round6(mean),
                    pixel_std=round6(std), image_shape=shape, label_counts={},
                    build={"max_broken_fraction": max_fraction,
                           **({"label_field": label_field} if label_field else {})},
                    shards=tuple(entries))


def _stats(entry: ShardEntry) -> ShardStats:
    """An indexed shard's pixel statistics (every entry :func:`_read_shard` makes has them).

    Raises:
        ShardError: an entry without them (an index written by hand or another version).
    """
    if entry.stats is None:
        raise ShardError(f"{entry.url}: the index entry has no pixel statistics (grey, "
                         "image_wh, pixels, pixel_sum, pixel_sq): index the set again")
    return entry.stats


# --- the labels of a labelled set, as build_shards will read them ---------------------------


def _kind(label: int | str) -> str:
    return "str" if isinstance(label, str) else "int"


def label_summary(labels: list[tuple[str, int | str | None]], where: str,
                  field: str) -> LabelSummary:
    """One shard's labels (its decodable samples' :func:`~pipeline.data.external.sample_label`).

    Args:
        labels: ``(key, label)`` per sample, in shard order.
        where: the shard, for messages.
        field: ``data.label_field``.

    Returns:
        The index entry's ``labels``: ``kind`` ``"int"``, ``"str"`` or None, ``counts``
        ``{class: samples}``, ``unlabelled`` samples, ``first`` ``(key, label)`` or None: the
        class of an integer label is its decimal text (``-1`` and a missing label count as
        unlabelled), ``first`` the first labelled sample (messages name it).

    Raises:
        ShardError: integer and string labels in the shard; names both samples.
    """
    counts: dict[str, int] = {}
    first: dict[str, tuple[str, int | str]] = {}
    unlabelled = 0
    for key, label in labels:
        if label is None or label == -1:
            unlabelled += 1
            continue
        first.setdefault(_kind(label), (key, label))
        counts[str(label)] = counts.get(str(label), 0) + 1
    if len(first) == 2:
        (ki, vi), (ks, vs) = first["int"], first["str"]
        raise ShardError(f"{where}: labels are integers and strings mixed: sample {ki!r} has "
                         f"{vi!r}, sample {ks!r} {vs!r} (data.label_field {field!r})")
    (kind, hit), = first.items() if first else [(None, None)]
    return LabelSummary(kind=kind, counts=dict(sorted(counts.items())), unlabelled=unlabelled,
                        first=tuple(hit) if hit else None)


def check_labels(entries: list[ShardEntry], spec: str, field: str) -> None:
    """Refuse the labels of a shard set that the build would refuse, naming shards and keys.

    Args:
        entries: the set's index entries, each with ``labels`` (:func:`label_summary`).
        spec: ``data.root``.
        field: ``data.label_field``.

    Raises:
        ShardError: integer labels in one shard and string labels in another (names both
            shards and a sample of each), or no labelled sample at all.
    """
    seen: dict[str, tuple[ShardEntry, LabelSummary]] = {}
    for entry in entries:
        labels = entry_labels(entry)
        if labels.kind is not None:
            seen.setdefault(labels.kind, (entry, labels))
    if len(seen) == 2:
        (ki, vi), (ks, vs) = (seen[k][1].first or ("", "") for k in ("int", "str"))
        raise ShardError(f"{seen['int'][0].url}: sample {ki!r} has {vi!r}, "
                         f"{seen['str'][0].url}: sample {ks!r} {vs!r}: labels are integers and "
                         f"strings mixed (data.label_field {field!r})")
    if not seen:
        raise ShardError(f"data.root = {spec!r}: no labelled sample (data.label_field "
                         f"{field!r}); data.source none pretrains without labels")


def entry_labels(entry: ShardEntry) -> LabelSummary:
    """An index entry's label summary (``index_shards`` with ``data.label_field`` makes it).

    Raises:
        ShardError: the entry has none (an index of unlabelled shards, or written by hand).
    """
    if entry.labels is None:
        raise ShardError(f"{entry.url}: the index entry has no label summary: index data.root "
                         "again (`dvc repro index_shards`)")
    return entry.labels


def index_shards(spec: str, *, split: str, key: str, max_broken_fraction: float,
                 previous: Manifest | None = None,
                 validators: dict[str, dict[str, Any]] | None = None,
                 label_field: str | None = None, workers: int = 1
                 ) -> tuple[Manifest, dict[str, dict[str, Any]]]:
    """Index one shard set, re-reading only the shards that changed since ``previous``.

    Args:
        spec: the set (:func:`pipeline.data.external.expand_shards`); "" = no shards.
        split: the manifest's ``split`` (``pretrain`` or ``labelled``).
        key: the param ``spec`` comes from, for messages.
        max_broken_fraction: ``data.max_broken_fraction``.
        previous: the last manifest of this set (its entries are reused when unchanged).
        validators: the last ``{location: {"bytes", "validator"}}``.
        label_field: ``data.label_field`` for a labelled set (``data.source: webdataset``):
            every entry then holds its samples' labels, read as the build reads them, and the
            set's labels are checked here, before ``build_shards`` deletes the shards
            (:func:`check_labels`); None for the pretraining shards, whose labels are never
            read. Entries of a ``previous`` index made with another ``label_field`` are read
            again.
        workers: processes that read the shards, one shard each (``data.build_workers``);
            the manifest is the same for any count.

    Returns:
        ``(manifest, validators)`` of the set as it is now.

    Raises:
        ShardError: a malformed spec or one naming no shard, a shard that cannot be listed,
            asked for its size or read, too many broken samples, or (with ``label_field``) a
            label the build would refuse: not an integer or string, below -1, integers and
            strings mixed, or none at all (one line naming the shard, the sample and
            ``data.label_field``).
    """
    if not spec.strip():
        return empty_manifest(split), {}
    t0 = time.monotonic()
    try:
        urls = expand_shards(spec, key=key)
        stats = shard_stat(urls)
    except (ValueError, RemoteError) as e:
        raise ShardError(str(e)) from None
    # keyed by URL, not by spec: the same shards spelled another way (a directory, a glob,
    # braces) are the same URLs, and their size and validator say whether they changed
    same_labels = (previous is not None
                   and previous.settings.get("label_field") == label_field)
    old = {s.url: s for s in (previous.shards if previous is not None else ())
           if s.url is not None and same_labels}
    kept: dict[str, ShardEntry] = {}
    for url, (nbytes, detector) in zip(urls, stats):
        last, seen = old.get(url), (validators or {}).get(url)
        if (last is not None and detector and seen == {"bytes": nbytes, "validator": detector}
                and last.bytes == nbytes):
            kept[url] = last
    read = _read_shards([u for u in urls if u not in kept], label_field, split, workers)
    entries, fresh = [], {}
    for url, (nbytes, detector) in zip(urls, stats):
        entry = kept.get(url) or read[url]
        if url in read and entry.bytes != nbytes:  # changed while being read: read again
            detector = ""
        entries.append(entry)
        fresh[url] = {"bytes": nbytes, "validator": detector}
    check_broken_budget(entries, max_broken_fraction, key)
    if label_field is not None:
        check_labels(entries, spec, label_field)
    manifest = _assemble(entries, split=split, max_fraction=max_broken_fraction,
                         label_field=label_field)
    reread = sum(1 for e, u in zip(entries, urls) if e is not old.get(u))
    log.info("index %s: %d shards (%d read, %d unchanged), %d images, %d broken skipped "
             "(%.1fs)", split, len(entries), reread, len(entries) - reread,
             manifest.num_samples, manifest.num_broken, time.monotonic() - t0)
    return manifest, fresh


def index_sets(sets: dict[str, tuple[str, str]], *, max_broken_fraction: float,
               label_fields: Mapping[str, str] | None = None, workers: int = 1
               ) -> tuple[dict[str, Manifest], dict[str, dict[str, Any]], bool]:
    """Index every shard set against its last manifest (:func:`index_shards` on each).

    Args:
        sets: ``{split: (spec, key)}``: each set's shard spec ("" = none) and the param it
            comes from, e.g. ``{"pretrain": (p.data.pretrain_shards, "data.pretrain_shards")}``.
        max_broken_fraction: ``data.max_broken_fraction``.
        label_fields: ``{split: data.label_field}`` of the labelled sets (their labels are
            read and checked: :func:`index_shards`' ``label_field``).
        workers: processes that read the shards (:func:`index_shards`).

    Returns:
        ``(manifests, validators, changed)``: ``{split: manifest}``, the change detectors of
        every shard now (for :data:`VALIDATORS`), and whether any manifest differs from the one
        on disk (:func:`read_previous`; the detectors alone never count as a change).

    Raises:
        ShardError: as :func:`index_shards`, for the first set that fails.
    """
    # none yet, or unreadable: every shard is read
    validators = read_json(VALIDATORS, unreadable="every shard is read again") or {}
    manifests, fresh, changed = {}, {}, False
    for split, (spec, key) in sets.items():
        previous = read_previous(split)
        manifests[split], found = index_shards(
            spec, split=split, key=key, max_broken_fraction=max_broken_fraction,
            previous=previous, validators=validators,
            label_field=(label_fields or {}).get(split), workers=workers)
        fresh.update(found)
        changed |= previous is None or previous.to_json() != manifests[split].to_json()
    return manifests, fresh, changed


def over_budget(n_broken: int, total: int, max_fraction: float) -> bool:
    """Whether ``n_broken`` of ``total`` is more than ``max_fraction`` of it.

    Compared to 9 decimals, so that a share written in params.yaml is met exactly: 29 of 100
    at 0.29 is within (``0.29 * 100`` is ``28.999999999999996`` in floats).
    """
    return n_broken > round(max_fraction * total, 9)


def pretrain_manifest(shards_dir: Path | ShardURL, index_dir: Path | None = None, *,
                      image_size: int = 0) -> Manifest:
    """The pretraining set: the built ``pretrain`` split joined with the indexed shards.

    Without an index (or an empty one) this is the built split's manifest unchanged. Otherwise
    every shard entry carries its location (``url``) and layout; the mode, normalisation and
    image size are those of the evaluation data (the built ``train`` split), so the encoder is
    trained on what it is evaluated on: other images are converted to that mode and, when their
    sizes differ, cropped per image in the loader workers to that size. Without labelled images
    the built pretrain split's, else the index's own, apply.

    Args:
        shards_dir: holds the built ``pretrain/`` and ``train/`` splits.
        index_dir: ``data/index/pretrain`` (the ``index_shards`` stage's output), or None.
        image_size: ``data.image_size``: the training crop when nothing else fixes it.

    Returns:
        A :class:`~pipeline.data.manifest.Manifest` (not written: the loader and the
        fingerprint read it).

    Raises:
        ShardError: a manifest is missing or invalid, there are no pretraining images at all,
            or the images have no single size and nothing fixes the crop size.
    """
    built = read_manifest(shards_dir / "pretrain")
    if index_dir is not None and not (index_dir / MANIFEST_NAME).is_file():
        raise ShardError(f"{index_dir}/{MANIFEST_NAME}: no index of data.pretrain_shards (the "
                         "index_shards stage writes it: `dvc repro`, or `python "
                         "stages/index_shards.py`)")
    ext = read_manifest(index_dir) if index_dir is not None else None
    if ext is None or not ext.num_samples:
        if not built.num_samples:
            raise ShardError(f"{shards_dir / 'pretrain'}: no pretraining images (set "
                             "data.unlabelled_root, data.pretrain_shards or "
                             "data.pretrain_labelled)")
        return built
    train = read_manifest(shards_dir / "train")
    candidates = [(train, shards_dir / "train"), (built, shards_dir / "pretrain"),
                  (ext, index_dir)]
    ref, ref_at = next((m, at) for m, at in candidates if m.num_samples)
    parts = [m for m in (built, ext) if m.num_samples]
    sides = {m.image_shape[1:] if m.image_shape else None for m in parts}
    spec = image_spec(ref, ref_at) if ref is not ext or ext.image_shape else None
    side = spec.size if spec is not None else image_size
    (h, w), = sides if len(sides) == 1 and None not in sides else [(None, None)]
    fixed = (h is not None and h == w and (spec is None or (not spec.variable and h == side)))
    if not fixed and not side:
        raise ShardError(f"{index_dir}: the pretraining images have no single square size and "
                         "no labelled split fixes one: set data.image_size (the training crop)")
    shards = tuple(replace(s, url=shard_location(shards_dir / "pretrain", s), layout=LAYOUT_OWN)
                   for s in built.shards) + ext.shards
    return replace(ref, split="pretrain", source="+".join(m.source for m in parts),
                   num_samples=sum(m.num_samples for m in parts),
                   num_broken=ext.num_broken if ext.num_broken is not None else 0,
                   image_shape=(CHANNELS[ref.mode], h, w) if fixed else None,
                   build={"image_size": side if not fixed else h, "variable": not fixed,
                          "parts": [str(shards_dir / "pretrain"), str(index_dir)]},
                   shards=shards)


def index_location(split: str) -> Path:
    """``data/index/<split>`` (holds ``manifest.json``)."""
    return INDEX_DIR / split


def read_previous(split: str) -> Manifest | None:
    """The last written manifest of a set, or None (missing or unreadable: index afresh)."""
    path = index_location(split)
    if not (path / MANIFEST_NAME).is_file():
        return None
    try:
        return read_manifest(path)
    except ShardError as e:
        log.warning("ignoring the last index %s (%s): indexing afresh", path, e)
        return None
