"""The folder index: local image folders listed, so a changed folder rebuilds the shards.

Local image folders (``data.unlabelled_root``; ``data.root`` of an ``imagefolder`` source) are
params naming a path: a file added to, changed in or removed from the folder changes no param.
The ``index_shards`` stage therefore lists them (:func:`index_folders`: every image's relative
path, byte size and mtime, by the tree walk of :mod:`pipeline.data.sources.unlabelled`) into
``data/index/folders.json`` (:data:`FOLDERS`), which ``build_shards`` depends on: a changed
folder rebuilds the shards, an unchanged one reruns nothing, and a folder that does not exist,
or an image file whose header does not decode, stops ``dvc repro`` here, before
``build_shards`` deletes the shards. Broken images are skipped and listed, up to
``data.max_broken_fraction`` (:func:`pipeline.data.index.over_budget`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.atomic import read_json
from pipeline.data.index import INDEX_DIR, over_budget
from pipeline.data.manifest import CHANNELS
from pipeline.data.modes import folder_mode
from pipeline.data.sources.base import SourceError, local_path
from pipeline.data.sources.files import read_images
from pipeline.data.sources.imagefolder import (
    IMAGE_EXTENSIONS,
    scan_folder,
    split_files,
)
from pipeline.data.sources.unlabelled import describe_skipped, walk_images

if TYPE_CHECKING:
    from pipeline.config import DataParams

log = logging.getLogger(__name__)

FOLDERS = INDEX_DIR / "folders.json"  # the listings of local image folders (index_folders)


def index_folders(folders: dict[str, str], previous: dict[str, Any] | None = None, *,
                  max_broken_fraction: float = 0.0,
                  listings: Mapping[str, tuple[list[str], Mapping[str, int]]] | None = None
                  ) -> dict[str, dict[str, Any]]:
    """The identity of local image folders: a digest of their listing; every image is decoded.

    Args:
        folders: ``{param key: directory}``, e.g. ``{"data.unlabelled_root": "/data/photos"}``;
            keys with an empty directory are left out.
        previous: the last index written (:func:`read_previous_folders`), or None. A folder
            whose root and listing digest equal its entry there passed the decode check then
            (an index is written only when every folder passed), so its images are not read
            again (unless its broken files are now over ``max_broken_fraction``).
        max_broken_fraction: ``data.max_broken_fraction``: files that do not decode are
            skipped, logged and listed while they are at most this share of a folder's
            image files; 0 = none (the default here; the stage passes the param).
        listings: ``{key: (image paths, skipped per reason)}`` of folders listed by the
            caller (an ImageFolder root: :func:`pipeline.data.sources.imagefolder.
            scan_folder`, the files its build reads); the other folders are walked whole.

    Returns:
        ``{key: {"root", "images", "bytes", "skipped", "listing_sha256", "mode"}}`` and, when
        some files do not decode within the budget, ``"broken"``: their paths relative to the
        folder, which ``build_shards`` leaves out (:func:`broken_in_folder`). ``mode``: ``L``
        when every good image is grey, else ``RGB`` (the folder rule the build applies to
        their headers; kept from ``previous`` while the listing is unchanged). ``images`` and
        ``bytes`` count the image files (``listings``, else
        :func:`pipeline.data.sources.unlabelled.walk_images`: any nesting), broken ones
        included; ``skipped``: the files skipped per reason
        (``appledouble``, ``hidden``, ``not_image``; only reasons that occur); and the sha256
        of the lines
        ``<relative path> TAB <bytes> TAB <mtime in ns>`` (``<relative path> TAB unreadable``
        for a symlink to nothing) in path order: an image added,
        removed, renamed, rewritten or touched changes it. (A README added beside the images
        changes ``skipped``, and a broken download ``broken``: ``build_shards`` reruns,
        writes the same shards, and nothing after it reruns.)

    Every image of a new or changed folder is decoded
    (:func:`pipeline.data.sources.files.read_images` with ``decode``: a JPEG at 1/8
    scale; timings in docs/data.md), so that a file with an image extension that is no image,
    or one cut short or corrupt past a good header, is found in ``index_shards``, before
    ``build_shards`` deletes the shards: listed and left out within ``max_broken_fraction``,
    else it stops ``dvc repro``, as a file in an unsupported mode always does. An unchanged
    folder costs the walk and the listing only.

    A symlink to nothing with an image extension (a photo moved or a disk not mounted) is a
    broken file like an empty one: listed under ``broken`` and left out within the budget
    (its listing line says so, so the target appearing changes the digest).

    Raises:
        SourceError: a folder is not a directory, holds no image, lists a file that is not a
            regular file (a FIFO), holds image files in an unsupported mode, or more than
            ``max_broken_fraction`` of its image files do not decode (header or pixels; a
            symlink to nothing counts); one line naming the key and the path(s).
    """
    out: dict[str, dict[str, Any]] = {}
    for key, root in folders.items():
        if not root:
            continue
        top = local_path(root)  # the main repo's in a queued or temp experiment's copy
        if not top.is_dir():
            raise SourceError(f"{key} = {root!r}: not a directory")
        paths, skipped = (listings or {}).get(key) or walk_images(top)
        skipped = {r: n for r, n in sorted(skipped.items()) if n}
        if not paths:
            raise SourceError(f"{key} = {root!r}: no images ({', '.join(IMAGE_EXTENSIONS)}) in "
                              f"the folder (skipped: {skipped or 'nothing'})")
        digest, total = hashlib.sha256(), 0
        for path in paths:
            rel = os.path.relpath(path, top)
            try:
                st = os.stat(path)
            except OSError:  # a dangling symlink (or removed while listed): a broken file,
                # listed as such, so that the target appearing changes the listing
                digest.update(f"{rel}\tunreadable\n".encode("utf-8", "surrogateescape"))
                continue
            if not stat.S_ISREG(st.st_mode):  # opening a FIFO would wait for a writer
                raise SourceError(f"{key}: {path}: not a regular file (a FIFO, socket or "
                                  "device)")
            total += st.st_size
            digest.update(f"{rel}\t{st.st_size}\t{st.st_mtime_ns}\n"
                          .encode("utf-8", "surrogateescape"))
        last = (previous or {}).get(key)
        unchanged = isinstance(last, dict) and last.get("mode") in CHANNELS and (
            (last.get("root"), last.get("listing_sha256")) == (root, digest.hexdigest()))
        broken = list(last.get("broken", [])) if unchanged else []
        if unchanged and not over_budget(len(broken), len(paths), max_broken_fraction):
            log.info("index %s %s: listing unchanged since the last index, images not read "
                     "again", key, root)
            mode = last["mode"]
        else:  # here, before build_shards deletes the shards, not in the build
            broken, mode = _decode_check(key, root, top, paths, max_broken_fraction)
        out[key] = {"root": root, "images": len(paths), "bytes": total, "skipped": skipped,
                    "listing_sha256": digest.hexdigest(), "mode": mode,
                    **({"broken": broken} if broken else {})}
        left_out = f"; {len(broken)} broken, left out by the build" if broken else ""
        log.info("index %s %s: %d images (%d bytes), skipped %s%s", key, root, len(paths),
                 total, describe_skipped(skipped), left_out)
    return out


def _decode_check(key: str, root: str, top: Path, paths: list[str],
                  max_fraction: float) -> tuple[list[str], str]:
    """Decode every image of a folder: the broken files' paths relative to ``top``, the mode.

    The mode is that of the good files by the folder rule
    (:func:`pipeline.data.modes.folder_mode`): ``L`` when all are grey, else ``RGB``,
    as the build decides it from their headers.

    Raises:
        SourceError: a file in an unsupported mode, or more than ``max_fraction`` of
            ``paths`` broken; one line naming the key, the folder and the files.
    """
    scan = read_images(paths, decode=True)
    over = over_budget(len(scan.bad), len(paths), max_fraction)
    if scan.unsupported or over:
        budget = (f"; {len(scan.bad)} of {len(paths)} images broken = "
                  f"{100 * len(scan.bad) / len(paths):.2f} % > data.max_broken_fraction "
                  f"{max_fraction:g} (fix or remove them, or raise it)" if over else "")
        raise SourceError(f"{key} = {root!r}: {scan.problems(with_bad=over)}{budget}")
    for item in scan.bad.values():
        log.warning("%s: skipping a broken image: %s", key, item)
    if scan.bad:
        log.warning("%s: %d of %d images skipped as broken (data.max_broken_fraction %g)",
                    key, len(scan.bad), len(paths), max_fraction)
    return sorted(os.path.relpath(p, top) for p in scan.bad), folder_mode(scan.kinds)


def broken_in_folder(key: str, root: str, index: dict[str, Any] | None,
                     max_fraction: float) -> frozenset[str]:
    """The files of a folder that ``index_shards`` found broken and the build leaves out.

    Args:
        key: ``data.unlabelled_root`` or ``data.root``.
        root: the folder as written in params.yaml.
        index: the folder index (:func:`read_previous_folders`), or None.
        max_fraction: ``data.max_broken_fraction`` now.

    Returns:
        Paths relative to the folder; empty without an index, or when its entry for ``key``
        is of another folder.

    Raises:
        SourceError: the index lists more broken files than ``max_fraction`` lets through (it
            was written under a larger budget: the build was run without ``index_shards``).
    """
    entry = (index or {}).get(key)
    if not isinstance(entry, dict) or entry.get("root") != root:
        return frozenset()
    broken = frozenset(str(p) for p in entry.get("broken", []))
    if over_budget(len(broken), int(entry.get("images", 0)), max_fraction):
        raise SourceError(f"{FOLDERS} lists {len(broken)} broken images of {entry.get('images')} "
                          f"in {key} = {root!r}, more than data.max_broken_fraction "
                          f"{max_fraction:g}: run index_shards first (`dvc repro`)")
    return broken


def index_params_folders(data: DataParams) -> dict[str, dict[str, Any]]:
    """:func:`index_folders` of the local folders ``build_shards`` reads, against the last index.

    The folders: ``data.unlabelled_root``, and ``data.root`` of an ``imagefolder`` source; the
    last index: :data:`FOLDERS` (:func:`read_previous_folders`). An ``imagefolder`` root is
    listed as its build reads it (:func:`pipeline.data.sources.imagefolder.scan_folder`: the
    class folders only, each file under the build's name), and its layout is checked without
    its broken files (:func:`pipeline.data.sources.imagefolder.split_files`); its entry also
    gives ``train_images``, the size of the build's train (and labelled pretrain) split.

    Raises:
        SourceError: as :func:`index_folders`; or a class layout the build would refuse
            (:func:`~pipeline.data.sources.imagefolder.scan_folder`,
            :func:`~pipeline.data.sources.imagefolder.split_files`).
    """
    root = data.root if data.source == "imagefolder" else ""
    scan = scan_folder(local_path(root)) if root and local_path(root).is_dir() else None
    index = index_folders({"data.unlabelled_root": data.unlabelled_root, "data.root": root},
                          previous=read_previous_folders(),
                          max_broken_fraction=data.max_broken_fraction,
                          listings={"data.root": (scan.paths, scan.skipped)} if scan else None)
    if scan is not None:
        _, files, _ = split_files(scan, data.test_fraction, 0,
                                  exclude=frozenset(index["data.root"].get("broken", [])))
        index["data.root"]["train_images"] = len(files["train"])
    return index


def read_previous_folders(path: Path = FOLDERS) -> dict[str, Any] | None:
    """The last folder index (``data/index/folders.json``), or None (missing or unreadable)."""
    return read_json(path, unreadable="checking every folder's headers")
