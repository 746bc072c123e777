"""``eval_loader``: every sample of a split exactly once, in manifest order.

The order is the one written at build time, the partial last batch is kept, for any
``num_workers``: global batch ``i`` is built by worker ``i % W`` and the DataLoader's round-robin
restores the order. A worker reads (without decoding) the shards that overlap its batches and
skips the others. Shards read in place (``layout: "webdataset"``) give their image member only,
label -1, the samples the index found broken skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset

from pipeline.data.manifest import LAYOUT_OWN, Manifest, ShardError, read_manifest
from pipeline.data.readers import (
    Shard,
    SizedLoader,
    check_args,
    decode_any,
    shard_list,
    worker_slot,
)
from pipeline.data.remote import ShardURL, shards_location
from pipeline.data.shards import decode_record, require_images

EvalTransform = Callable[[Image.Image], torch.Tensor]


class _EvalStream(IterableDataset):
    """This worker's batches ``i % W == worker`` of the first ``total`` samples."""

    def __init__(self, shards: list[Shard], mode: str, transform: EvalTransform, *,
                 batch_size: int, total: int):
        super().__init__()
        self.shards, self.mode, self.transform = shards, mode, transform
        self.batch_size, self.total = batch_size, total

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        worker, num_workers = worker_slot()
        b = self.batch_size
        start = 0
        pending: list[tuple[torch.Tensor, int, str]] = []
        for shard in self.shards:
            url, count = shard.url, shard.count
            end = min(start + count, self.total)
            if start >= end:
                break
            first_batch, last_batch = start // b, (end - 1) // b
            if not any(i % num_workers == worker for i in range(first_batch, last_batch + 1)):
                start += count
                continue
            seen = 0
            for record in shard.records():  # broken samples of a shard read in place left out
                g = start + seen  # global position in manifest order
                seen += 1
                if g >= end:
                    if end < start + count:
                        break  # max_images reached inside this shard
                    raise ShardError(f"{url}: more samples than the manifest's {count}")
                i = g // b
                if i % num_workers != worker:
                    continue
                if shard.layout == LAYOUT_OWN:
                    key, image, label = decode_record(record, self.mode)
                else:  # read in place: the image only, unlabelled
                    record["__layout__"] = shard.layout
                    key, image, label = str(record["__key__"]), decode_any(record, self.mode), -1
                pending.append((self.transform(image), label, key))
                if g == min((i + 1) * b, self.total) - 1:  # last sample of batch i
                    yield _collate_eval(pending)
                    pending = []
            if seen < end - start:
                raise ShardError(f"{url}: {seen} samples, manifest says {count}")
            start += count


def _collate_eval(items: list[tuple[torch.Tensor, int, str]]
                  ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    images = torch.stack([x for x, _, _ in items])
    labels = torch.tensor([y for _, y, _ in items], dtype=torch.long)
    return images, labels, [k for _, _, k in items]


def eval_loader(manifest_dir: str | Path | ShardURL, *, transform: EvalTransform, batch_size: int,
                num_workers: int = 0, max_images: int = 0,
                pin_memory: bool = False, manifest: Manifest | None = None) -> DataLoader:
    """Every sample of a split exactly once, in manifest order.

    "Deterministic order" means the order the samples were written at build time (a seeded
    shuffle of the source), identical for every ``num_workers``; the returned keys let callers
    align outputs with samples. Shards read in place (``layout: "webdataset"``, e.g. the index
    of ``data.pretrain_shards``) give their image member only, label -1, broken samples skipped.

    Args:
        manifest_dir: the split directory (``<shards_dir>/train`` or ``/test``), or its URL.
        transform: ``transform(img) -> (C, H, W)`` float tensor, deterministic.
        batch_size: images per batch; the last batch may be smaller.
        num_workers: DataLoader worker processes (0 = in-process).
        max_images: only the first ``max_images`` samples in manifest order (0 = all).
        pin_memory: DataLoader ``pin_memory``.
        manifest: the manifest to read instead of ``manifest_dir``'s (e.g.
            :func:`pipeline.data.index.pretrain_manifest`'s, whose entries carry their ``url``).

    Returns:
        A DataLoader (``len()`` = number of batches) yielding ``(images (B, C, H, W), labels
        (B,) int64, keys list[str] of length B)``.

    Raises:
        ValueError: an argument out of range (names it).
        ShardError: missing/invalid manifest; a shard missing or differing from the manifest in
            size or sha256 (at call time); a corrupt sample (during iteration).
        LoaderWorkerError: a worker died, or (:class:`~pipeline.data.workers.SharedMemoryError`)
            ``/dev/shm`` had no room for a batch (during iteration).
    """
    check_args(batch_size=(batch_size, 1), num_workers=(num_workers, 0),
                max_images=(max_images, 0))
    directory = shards_location(manifest_dir)
    manifest = read_manifest(directory) if manifest is None else manifest
    require_images(manifest, directory)
    total = min(max_images, manifest.num_samples) if max_images else manifest.num_samples
    stream = _EvalStream(shard_list(directory, manifest), manifest.mode, transform,
                         batch_size=batch_size, total=total)
    return SizedLoader(stream, math.ceil(total / batch_size), num_workers, pin_memory)
