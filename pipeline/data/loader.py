"""WebDataset input pipelines over a split's shards (the explicit list from its manifest).

``train_loader`` — MoCo pretraining, one epoch of one rank, as uint8 batches: a true epoch (every
image at most once, all but a remainder of less than one global batch exactly once), in an order
that is a pure function of ``(seed, epoch)`` (see :func:`train_loader` for the design). Workers
only read and decode; the two augmented views are made per batch on the training device
(:mod:`pipeline.data.views`).

``eval_loader`` (every sample once, in manifest order) is in :mod:`pipeline.data.eval_loader`;
what both share (the shard list, checked against the manifest, and the DataLoader) in
:mod:`pipeline.data.readers`.

Only ``.png``/``.jpg``/``.cls`` members are decoded (with PIL / as ASCII); pickle-like members
are refused with an error naming the shard and key. Whole images (``data.max_side``) are cut
into their views in the workers, and a JPEG there is decoded only as finely as its views need
(:meth:`pipeline.data.views.SeededRandomResizedCrop.draft_scale`), or, with
``decode="device"``, on the training device (:mod:`pipeline.data.jpeg`).

The pretraining set may also list shards read in place from elsewhere (``url`` entries with
``layout: "webdataset"``, see :mod:`pipeline.data.index`): of those only the image member is
decoded (to the set's mode, by :func:`pipeline.data.modes.to_mode`), every other member
is ignored, and the samples the index found broken are skipped before any position is counted,
so the epoch stays exact.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset

from pipeline.data.external import orientation, upright_size
from pipeline.data.jpeg import cut_views, decode_jpeg_bytes, is_jpeg, reduction
from pipeline.data.manifest import CHANNELS, LAYOUT_OWN, Manifest, ShardError, read_manifest
from pipeline.data.readers import (
    Shard,
    SizedLoader,
    check_args,
    decode_any,
    image_bytes,
    open_header,
    shard_list,
    worker_slot,
)
from pipeline.data.remote import ShardURL, shards_location
from pipeline.data.shards import check_members
from pipeline.errors import InputError
from pipeline.seeds import derive_seed

if TYPE_CHECKING:  # views imports kornia: the evaluation stages never need it
    from pipeline.data.views import SeededRandomResizedCrop

__all__ = ["ShardError", "read_manifest", "train_loader"]

SHUFFLE_BUDGET_BYTES = 512 * 2**20  # raw sample bytes each train reader may buffer (auto size)
DECODE_WORKERS, DECODE_DEVICE = "workers", "device"  # train_loader(decode=...), pretrain.decode



def epoch_order(counts: list[int], *, seed: int, epoch: int) -> tuple[list[int], int]:
    """The epoch's global sample order: a shard permutation and a cyclic offset.

    The epoch's sequence is the shards in permuted order, concatenated (tar order inside each
    shard), then rotated left by ``offset`` samples. Readers take contiguous slices of it and
    shuffle inside their slice; the remainder that fills no global batch is the sequence's tail,
    so the rotation makes the dropped images different every epoch.

    Args:
        counts: samples per shard, in manifest order.
        seed: the run seed.
        epoch: 0-based epoch.

    Returns:
        ``(permutation, offset)``: shard indices in epoch order and ``0 <= offset < sum(counts)``.
    """
    rng = random.Random(derive_seed("epoch-order", seed, epoch))
    perm = list(range(len(counts)))
    rng.shuffle(perm)
    return perm, rng.randrange(max(1, sum(counts)))


def reader_runs(counts: list[int], perm: list[int], offset: int, start: int,
                length: int) -> list[tuple[int, int, int]]:
    """Map a slice ``[start, start + length)`` of the rotated epoch sequence to shard runs.

    Args:
        counts: samples per shard, manifest order.
        perm: shard indices in epoch order (:func:`epoch_order`).
        offset: the epoch's rotation.
        start: first position in the rotated sequence.
        length: number of positions; ``start + length <= sum(counts)``.

    Returns:
        ``(shard index, first sample, end sample)`` runs in reading order.
    """
    total = sum(counts)
    bounds, acc = [], 0  # (shard, begin, end) of each shard in the un-rotated sequence
    for i in perm:
        bounds.append((i, acc, acc + counts[i]))
        acc += counts[i]
    runs: list[tuple[int, int, int]] = []
    pos, left = (start + offset) % max(total, 1), length
    while left > 0:
        for shard, begin, end in bounds:
            if begin <= pos < end:
                take = min(left, end - pos)
                if runs and runs[-1][0] == shard and runs[-1][2] == pos - begin:
                    runs[-1] = (shard, runs[-1][1], runs[-1][2] + take)
                else:
                    runs.append((shard, pos - begin, pos - begin + take))
                left -= take
                pos = (pos + take) % total
                break
    return runs


class _TrainStream(IterableDataset):
    """One reader's share of one rank's epoch: raw samples → shuffle → uint8 batches."""

    def __init__(self, shards: list[Shard], mode: str, *, batch_size: int, steps: int,
                 epoch: int, seed: int, rank: int, world_size: int, skip_batches: int,
                 shuffle_buffer: int, crop: SeededRandomResizedCrop | None = None,
                 views: int = 2, draft: bool = True, decode: str = DECODE_WORKERS):
        super().__init__()
        self.shards, self.mode, self.crop, self.views = shards, mode, crop, views
        self.draft, self.decode = draft, decode
        self.batch_size, self.steps, self.epoch, self.seed = batch_size, steps, epoch, seed
        self.rank, self.world_size = rank, world_size
        self.skip_batches, self.shuffle_buffer = skip_batches, shuffle_buffer

    def _plan(self) -> tuple[int, int, list[int]]:
        """(logical worker, number of its batches to drop, global indices of batches to yield)."""
        worker, num_workers = worker_slot()
        logical = (worker + self.skip_batches) % num_workers
        mine = range(logical, self.steps, num_workers)
        dropped = sum(1 for i in mine if i < self.skip_batches)
        return logical, dropped, [i for i in mine if i >= self.skip_batches]

    def _slice(self, logical: int) -> tuple[int, int]:
        """(start, length) of this reader's slice of the rotated epoch sequence.

        Readers are laid out rank-major, then by logical worker; each holds exactly the samples
        of the batches it builds, so all slices together are the first ``steps * batch_size *
        world_size`` positions and no position is read twice.
        """
        num_workers = worker_slot()[1]
        per_worker = [len(range(w, self.steps, num_workers)) * self.batch_size
                      for w in range(num_workers)]
        start = self.rank * self.steps * self.batch_size + sum(per_worker[:logical])
        return start, per_worker[logical]

    def _raw(self, logical: int) -> Iterator[dict[str, Any]]:
        counts = [s.count for s in self.shards]
        perm, offset = epoch_order(counts, seed=self.seed, epoch=self.epoch)
        start, length = self._slice(logical)
        position = start  # in the rotated epoch sequence: seeds per-image crops
        for shard, first, end in reader_runs(counts, perm, offset, start, length):
            sh = self.shards[shard]
            got = 0
            if sh.expect is None:  # local, checked already: stop reading at the run's end
                records = itertools.islice(sh.records(), first, end)
            else:  # a URL: read to the end of the shard so its sha256 is checked
                records = (r for i, r in enumerate(sh.records()) if first <= i < end)
            for record in records:
                got += 1
                record["__pos__"] = position
                record["__layout__"] = sh.layout
                position += 1
                yield check_members(record) if sh.layout == LAYOUT_OWN else record
            if got != end - first:
                raise ShardError(f"{sh.url}: fewer samples than the manifest's {sh.count}")

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        logical, dropped, batches = self._plan()
        if not batches:
            return iter(())
        b = self.batch_size
        start, length = self._slice(logical)
        rng = random.Random(derive_seed("buffer", self.seed, self.epoch, self.rank, logical,
                                      worker_slot()[1]))
        buffer = max(1, min(length, self.shuffle_buffer))

        def take(src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
            # drop whole batches as raw bytes (cheap resume), then exactly the batches to yield
            return itertools.islice(src, dropped * b, (dropped + len(batches)) * b)

        def decode(src: Iterator[dict[str, Any]]) -> Iterator[Any]:
            for record in src:
                key = str(record["__key__"])
                if self.crop is None:
                    yield _to_uint8(decode_any(record, self.mode)), key
                    continue
                # the views' crops, a pure function of (seed, epoch, position, view)
                seeds = [derive_seed("crop", self.seed, self.epoch, record["__pos__"], v)
                         for v in range(self.views)]
                if self.decode == DECODE_DEVICE:
                    yield self._encoded(record, seeds, key)
                else:
                    yield self._cut(record, seeds), key

        collate: Callable[[list[Any]], Any] = _stack_uint8
        if self.crop is not None and self.decode == DECODE_DEVICE:
            side = self.crop.size
            collate = functools.partial(_collate_encoded, shape=(
                self.views, CHANNELS[self.mode], side, side))
        pipeline = wds.DataPipeline(
            lambda: self._raw(logical),
            wds.shuffle(buffer, initial=buffer, rng=rng),
            take,
            decode,
            wds.batched(b, collation_fn=collate, partial=False),
        )
        return iter(pipeline)

    def _cut(self, record: dict[str, Any], seeds: list[int]) -> np.ndarray:
        """``(V, C, S, S)`` uint8: the views of one sample, decoded as little as they need.

        The boxes come from a JPEG's header (its size as displayed: EXIF orientation applied,
        as every decode here applies it). A JPEG whose boxes allow it is decoded by PIL at a
        reduced DCT scale (``draft``,
        :meth:`pipeline.data.views.SeededRandomResizedCrop.draft_scale`); another JPEG by
        torchvision's ``decode_jpeg`` (faster per core than PIL, docs/performance.md); any
        other format by PIL, whole, its boxes drawn from the decoded size (a PNG's ``eXIf``
        chunk may follow its pixels, where a header read does not see it). The views are cut
        from the uint8 tensor (:func:`pipeline.data.jpeg.cut_views`).

        Raises:
            ShardError: the image does not decode (names the shard and key).
        """
        assert self.crop is not None
        crop, data = self.crop, image_bytes(record)
        if not is_jpeg(data):
            decoded = decode_any(record, self.mode)
            return cut_views(_tensor(decoded), crop.boxes(decoded.size, seeds), crop.size).numpy()
        with open_header(data, record) as header:
            full, turn = upright_size(header), orientation(header)
        boxes = crop.boxes(full, seeds)
        scale = crop.draft_scale(boxes) if self.draft else 1
        if scale == 1:
            try:
                image = decode_jpeg_bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                                          CHANNELS[self.mode], orientation=turn)
                return cut_views(image, boxes, crop.size).numpy()
            except RuntimeError:  # a JPEG torchvision refuses (CMYK...): PIL decides below
                pass
        decoded = decode_any(record, self.mode, reduce=lambda _: scale)
        return cut_views(_tensor(decoded), boxes, crop.size,
                         reduction(full, decoded.size)).numpy()

    def _encoded(self, record: dict[str, Any], seeds: list[int], key: str
                 ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None, int, str, str]:
        """A JPEG's bytes and boxes, its header alone read (``decode="device"``).

        Returns:
            ``(jpeg, boxes, views, orientation, key, shard)``: the JPEG as uint8 bytes, its
            ``(V, 4)`` boxes in the upright image and its EXIF orientation, with ``views``
            None; or, for another format, ``jpeg`` None and the views cut here (:meth:`_cut`).

        Raises:
            ShardError: the header does not parse (names the shard and key).
        """
        assert self.crop is not None
        data = image_bytes(record)
        where = str(record.get("__url__"))
        if not is_jpeg(data):
            views = self._cut(record, seeds)
            boxes = np.zeros((self.views, 4), dtype=np.int64)
            return None, boxes, views, 1, key, where
        with open_header(data, record) as header:
            full, turn = upright_size(header), orientation(header)
        boxes = np.asarray(self.crop.boxes(full, seeds), dtype=np.int64)
        return np.frombuffer(data, dtype=np.uint8), boxes, None, turn, key, where


@dataclass
class EncodedBatch:
    """One batch whose JPEGs are still compressed; :meth:`to` decodes and crops them.

    Attributes:
        jpegs: per sample, its JPEG bytes as a ``(n_bytes,)`` uint8 tensor, or an empty tensor
            when :attr:`done` already holds its views (a member that is not a JPEG).
        boxes: ``(B, V, 4)`` int64 crop boxes ``(top, left, height, width)`` in pixels of each
            full image as displayed, one per view.
        orientations: per sample, its JPEG's EXIF orientation (1..8; 1 for the others),
            applied after the decode (:func:`pipeline.data.jpeg.upright`).
        done: ``(B, V, C, S, S)`` uint8: the views cut in the workers (zeros for JPEGs).
        keys: the ``B`` sample keys.
        where: the ``B`` shard locations, for messages.
    """

    jpegs: list[torch.Tensor]
    boxes: torch.Tensor
    orientations: list[int]
    done: torch.Tensor
    keys: list[str]
    where: list[str]

    def pin_memory(self) -> EncodedBatch:
        """The DataLoader's ``pin_memory`` hook: pins the tensors' pages."""
        return EncodedBatch([j.pin_memory() for j in self.jpegs], self.boxes.pin_memory(),
                            self.orientations, self.done.pin_memory(), self.keys, self.where)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor:
        """Decode the JPEGs on ``device`` and cut their views: the batch the step takes.

        Args:
            device: the training device (CUDA: nvjpeg; CPU: libjpeg-turbo).
            non_blocking: passed to the copy of :attr:`done`.

        Returns:
            ``(B, V, C, S, S)`` uint8 on ``device``.

        Raises:
            ShardError: a JPEG torchvision cannot decode (names the shard and key).
        """
        out = self.done.to(device, non_blocking=non_blocking)
        todo = [i for i, j in enumerate(self.jpegs) if j.numel()]
        if not todo:
            return out
        _, _, channels, side, _ = out.shape
        try:
            images = decode_jpeg_bytes([self.jpegs[i] for i in todo], channels, device,
                                       orientation=[self.orientations[i] for i in todo])
        except RuntimeError:  # decode one by one to name the sample
            images = [self._decode_one(i, channels, device) for i in todo]
        for i, image in zip(todo, images):
            out[i] = cut_views(image, [tuple(b) for b in self.boxes[i].tolist()], side)
        return out

    def _decode_one(self, i: int, channels: int, device: torch.device | str) -> torch.Tensor:
        try:
            return decode_jpeg_bytes(self.jpegs[i], channels, device,
                                     orientation=self.orientations[i])
        except RuntimeError as e:
            raise ShardError(f"{self.where[i]}: sample '{self.keys[i]}' does not decode on "
                             f"{device} ({str(e).splitlines()[0]})") from None


def _collate_encoded(items: list[tuple[np.ndarray | None, np.ndarray, np.ndarray | None, int,
                                       str, str]], shape: tuple[int, int, int, int]
                     ) -> tuple[EncodedBatch, list[str]]:
    """An :class:`EncodedBatch` of :meth:`_TrainStream._encoded`.

    ``shape``: ``(V, C, S, S)`` of one sample's views.
    """
    done = np.zeros((len(items), *shape), dtype=np.uint8)
    jpegs = []
    for i, (jpeg, _, views, _, _, _) in enumerate(items):
        jpegs.append(torch.from_numpy(jpeg.copy()) if jpeg is not None
                     else torch.zeros(0, dtype=torch.uint8))
        if views is not None:
            done[i] = views
    boxes = torch.from_numpy(np.stack([bx for _, bx, *_ in items]))
    turns = [int(o) for _, _, _, o, _, _ in items]
    keys = [k for *_, k, _ in items]
    return EncodedBatch(jpegs, boxes, turns, torch.from_numpy(done), keys,
                        [w for *_, w in items]), keys


def _tensor(image: Image.Image) -> torch.Tensor:
    """``(C, H, W)`` uint8 tensor of a decoded ``L`` or ``RGB`` image (its own, writable copy)."""
    a = np.array(image, dtype=np.uint8)  # writable: torch refuses read-only arrays
    return torch.from_numpy(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))


def _to_uint8(image: Image.Image) -> np.ndarray:
    """``(C, H, W)`` uint8 array of a decoded ``L`` or ``RGB`` image."""
    a = np.asarray(image, dtype=np.uint8)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def _stack_uint8(items: list[tuple[np.ndarray, str]]) -> tuple[torch.Tensor, list[str]]:
    return torch.from_numpy(np.stack([a for a, _ in items])), [k for _, k in items]


def auto_shuffle_buffer(manifest: Manifest, budget_bytes: int = SHUFFLE_BUDGET_BYTES) -> int:
    """Samples that fit the shuffle budget, from the manifest's mean bytes per sample.

    The buffer holds raw (encoded) samples. Whenever a reader's slice fits in it — always for
    Fashion-MNIST, CIFAR and STL-10 at the default budget — the slice is shuffled by a uniform
    random permutation; for larger data the shard permutation does most of the mixing.

    Args:
        manifest: a split's manifest (``shards[].bytes``, ``num_samples``).
        budget_bytes: memory allowed per reader, in bytes.

    Returns:
        The buffer size in samples (>= 1000).
    """
    total_bytes = sum(s.bytes for s in manifest.shards)
    per_sample = max(1.0, total_bytes / max(1, manifest.num_samples))
    return max(1000, int(budget_bytes / per_sample))


def train_loader(manifest_dir: str | Path | ShardURL, *, batch_size: int, steps: int, epoch: int,
                 seed: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                 skip_batches: int = 0, shuffle_buffer: int = 0,
                 pin_memory: bool = False, crop: SeededRandomResizedCrop | None = None,
                 views: int = 2, manifest: Manifest | None = None, draft: bool = True,
                 decode: str = DECODE_WORKERS) -> DataLoader:
    """One rank's batches of one epoch, as uint8 images (augmentation happens on the device).

    Every image of the split is yielded at most once per epoch across all ranks and workers:
    the epoch uses the first ``steps * batch_size * world_size`` positions of a seeded order and
    drops the rest (less than one global batch when ``steps = images // global batch``, the
    full epoch). The order is a pure function of ``(seed, epoch)``:

    1. :func:`epoch_order` permutes the shards and picks a cyclic offset; the epoch sequence is
       the permuted shards concatenated and rotated by the offset (so the dropped remainder
       moves every epoch).
    2. The sequence is cut into contiguous slices, one per (rank, worker) reader, each exactly
       as long as the batches that reader builds. Slices may start and end inside a shard, so
       any number of readers works with any number of shards (fewer shards than readers
       included) without drawing anything twice: splitting inside shards was chosen over
       deriving more shards because it needs no rebuild and costs only a skip over raw tar
       members.
    3. Each reader shuffles its slice through a buffer (``shuffle_buffer`` samples, seeded by
       ``(seed, epoch, rank, worker)``); when the slice fits the buffer this is a uniform
       permutation of the slice.

    With ``W`` workers the rank's batch ``i`` is built by logical worker ``i % W`` (the
    DataLoader returns worker outputs round-robin). ``skip_batches=s`` rotates the logical worker
    ids by ``s`` and drops each worker's first batches as raw bytes, before decoding, so a
    resumed epoch yields exactly batches ``s..steps-1`` of the uninterrupted one.

    Args:
        manifest_dir: the split directory (``<shards_dir>/pretrain``), or its URL.
        batch_size: images per batch on this rank (global batch / world size).
        steps: batches this epoch, per rank; every rank yields exactly this many.
        epoch: 0-based epoch (changes the order).
        seed: the run seed.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks.
        num_workers: DataLoader worker processes (0 = in-process); they only read and decode.
        skip_batches: resume: yield only batches ``skip_batches..steps-1`` of this epoch.
        shuffle_buffer: samples in each reader's shuffle buffer (raw bytes); 0 = auto
            (:func:`auto_shuffle_buffer`, a 512 MiB budget per reader).
        pin_memory: DataLoader ``pin_memory``.
        crop: for shards of variable image size (``data.max_side``): the per-image crop
            (:class:`pipeline.data.views.SeededRandomResizedCrop`). It runs in the workers,
            ``views`` times per image, seeded by ``(seed, epoch, position of the sample in the
            epoch sequence, view)``: the crops do not depend on the number of ranks or
            workers, and a resumed epoch repeats them.
        views: crops per image when ``crop`` is given (2: MoCo's query and key).
        draft: with ``crop``, decode a JPEG at the largest DCT reduction (1/2, 1/4, 1/8)
            that leaves every view's box at least the crop's side (PIL ``draft``, chosen from
            the boxes drawn from the header, so the boxes are those of a full decode); False
            decodes every image in full (``benchmarks/photo_loader.py`` compares the two).
        decode: with ``crop``: ``"workers"`` (PIL in the workers) or ``"device"``: the
            workers read only each JPEG's header and yield
            :class:`EncodedBatch` batches, whose ``.to(device)``
            decodes them there (``pretrain.decode``).
        manifest: the split's manifest when it is not (only) ``manifest_dir``'s, e.g. the
            pretraining set joined with indexed shards
            (:func:`pipeline.data.index.pretrain_manifest`); ``manifest_dir`` then only names
            it in messages.

    Returns:
        A DataLoader (``len() == steps - skip_batches``) yielding ``(images, keys)``: images
        ``(B, C, H, W)`` uint8 (``(B, views, C, S, S)`` with ``crop``; an
        :class:`EncodedBatch` that ``.to(device)`` turns into it
        with ``decode="device"``), keys the ``B`` sample keys.

    Raises:
        ValueError: an argument out of range, or ``steps * batch_size * world_size`` exceeds the
            split's images (names them).
        ShardError: missing/invalid manifest; a shard missing or differing from the manifest in
            size or sha256 (at call time); a corrupt sample (during iteration).
        LoaderWorkerError: a worker died, or (:class:`~pipeline.data.workers.SharedMemoryError`)
            ``/dev/shm`` had no room for a batch (during iteration).
    """
    check_args(batch_size=(batch_size, 1), steps=(steps, 1), epoch=(epoch, 0), seed=(seed, 0),
                world_size=(world_size, 1), rank=(rank, 0), num_workers=(num_workers, 0),
                skip_batches=(skip_batches, 0), shuffle_buffer=(shuffle_buffer, 0),
                views=(views, 1))
    if rank >= world_size:
        raise InputError(f"rank must be < world_size ({world_size}), got {rank}")
    if decode not in (DECODE_WORKERS, DECODE_DEVICE):
        raise InputError(f"decode must be {DECODE_WORKERS!r} or {DECODE_DEVICE!r}, got "
                         f"{decode!r} (pretrain.decode)")
    if skip_batches > steps:
        raise InputError(f"skip_batches must be <= steps ({steps}), got {skip_batches}")
    directory = shards_location(manifest_dir)
    manifest = read_manifest(directory) if manifest is None else manifest
    n = manifest.num_samples
    if steps * batch_size * world_size > n:
        raise InputError(f"{directory}: an epoch of {steps} steps x {batch_size} images x "
                         f"{world_size} ranks needs {steps * batch_size * world_size} images, "
                         f"the split has {n} (lower pretrain.steps_per_epoch or batch_size)")
    stream = _TrainStream(shard_list(directory, manifest), manifest.mode,
                          batch_size=batch_size, steps=steps,
                          epoch=epoch, seed=seed, rank=rank, world_size=world_size,
                          skip_batches=skip_batches,
                          shuffle_buffer=shuffle_buffer or auto_shuffle_buffer(manifest),
                          crop=crop, views=views, draft=draft, decode=decode)
    return SizedLoader(stream, steps - skip_batches, num_workers, pin_memory)
