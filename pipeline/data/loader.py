"""WebDataset input pipelines over a split's shards (the explicit list from its manifest).

``train_loader`` — MoCo pretraining, one epoch:

* Every (rank, worker) stream draws shards with replacement (resampled, as WebDataset advises
  for multi-node training) with an RNG seeded by ``(seed, epoch, rank, worker, num_workers)``,
  then shuffles samples through a buffer seeded the same way. A new ``epoch`` gives a new order;
  the same arguments give the same batches, bit for bit.
* Each rank yields exactly ``steps`` full batches whatever the shard count (even fewer shards
  than ranks x workers) or worker count, so DDP ranks never wait on each other.
* With ``W`` DataLoader workers, the rank's batch ``i`` is built by logical worker ``i % W``
  (PyTorch's DataLoader returns worker outputs round-robin). ``skip_batches=s`` rotates the
  logical worker ids by ``s`` and drops each worker's first batches as raw bytes, before any
  decoding or augmentation, so a resumed epoch yields exactly batches ``s..steps-1`` of the
  uninterrupted one.
* ``transform(img, sample_seed)`` gets the per-sample seed
  :func:`pipeline.data.augment.sample_seed` ``(seed, epoch, key, draw)``, where
  ``draw = (batch * world_size + rank) * batch_size + slot`` is unique within the epoch across
  ranks (a shard may be drawn twice, so the key alone does not identify a draw).

``eval_loader`` — every sample exactly once, in manifest order (the order written at build
time), partial last batch kept, for any ``num_workers``: global batch ``i`` is built by worker
``i % W`` and the DataLoader's round-robin restores the order. A worker reads (without
decoding) the shards that overlap its batches and skips the others.

Only ``.png``/``.jpg``/``.cls`` members are decoded (with PIL / as ASCII); pickle-like members
are refused with an error naming the shard and key.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.data.augment import sample_seed
from pipeline.data.shards import (
    ShardError,
    check_members,
    decode_record,
    iter_shard,
    read_manifest,
    sha256_file,
)

__all__ = ["ShardError", "eval_loader", "read_manifest", "train_loader"]

TwoCropTransform = Callable[[Image.Image, int], tuple[torch.Tensor, torch.Tensor]]
EvalTransform = Callable[[Image.Image], torch.Tensor]


def _seed_int(*parts: Any) -> int:
    """A 63-bit integer seed from any printable parts (stable across processes and runs)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _identity(x: Any) -> Any:
    return x


# (path, size, mtime_ns) -> sha256 of shards hashed in this process: each file is read once even
# though a loader is built every epoch.
_DIGESTS: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    key = (str(path.resolve()), size, mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(path)
    return _DIGESTS[key]


def _shard_urls(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """The shard paths in manifest order, each present with the manifest's byte size and sha256.

    A shard cut at a member boundary still reads as a valid, shorter tar, and a shard whose
    bytes were altered may still decode: without these checks a stage would silently train or
    evaluate on other data than the manifest (and DVC) describe. The sha256 of each file is
    computed once per process (cached by path, size and mtime).

    Raises:
        ShardError: a shard is missing, or its size or sha256 differs from the manifest (names
            the file).
    """
    urls = []
    for s in manifest["shards"]:
        path = directory / s["name"]
        if not path.is_file():
            raise ShardError(f"{path}: shard listed in the manifest is missing")
        st = path.stat()
        if st.st_size != s["bytes"]:
            raise ShardError(f"{path}: {st.st_size} bytes, manifest says {s['bytes']} (truncated "
                             "or altered; check with `python -m pipeline verify-shards`)")
        digest = _file_sha256(path, st.st_size, st.st_mtime_ns)
        if digest != s["sha256"]:
            raise ShardError(f"{path}: sha256 {digest[:16]}... != manifest {s['sha256'][:16]}... "
                             "(altered; rebuild with `dvc repro -f build_shards`)")
        urls.append(str(path))
    return urls


class _TrainStream(IterableDataset):
    """One rank's epoch: this worker's share of ``steps`` batches of two-crop views."""

    def __init__(self, urls: list[str], mode: str, transform: TwoCropTransform, *,
                 batch_size: int, steps: int, epoch: int, seed: int, rank: int, world_size: int,
                 skip_batches: int, shuffle_buffer: int):
        super().__init__()
        self.urls, self.mode, self.transform = urls, mode, transform
        self.batch_size, self.steps, self.epoch, self.seed = batch_size, steps, epoch, seed
        self.rank, self.world_size = rank, world_size
        self.skip_batches, self.shuffle_buffer = skip_batches, shuffle_buffer

    def _plan(self) -> tuple[int, int, list[int]]:
        """(logical worker, number of its batches to drop, global indices of batches to yield)."""
        worker, num_workers = _worker()
        logical = (worker + self.skip_batches) % num_workers
        mine = range(logical, self.steps, num_workers)
        dropped = sum(1 for i in mine if i < self.skip_batches)
        return logical, dropped, [i for i in mine if i >= self.skip_batches]

    def _resampled(self, logical: int) -> Iterator[dict[str, str]]:
        rng = random.Random(_seed_int("shards", self.seed, self.epoch, self.rank, logical,
                                      _worker()[1]))
        while True:
            yield {"url": rng.choice(self.urls)}

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        logical, dropped, batches = self._plan()
        if not batches:
            return iter(())
        b = self.batch_size
        buffer_rng = random.Random(_seed_int("buffer", self.seed, self.epoch, self.rank, logical,
                                             _worker()[1]))

        def take(src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
            # drop whole batches as raw bytes (cheap resume), then exactly the batches to yield
            return itertools.islice(src, dropped * b, (dropped + len(batches)) * b)

        def views(src: Iterator[dict[str, Any]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for n, record in enumerate(src):
                key, image, _ = decode_record(record, self.mode)
                draw = (batches[n // b] * self.world_size + self.rank) * b + n % b
                yield self.transform(image, sample_seed(self.seed, self.epoch, key, draw))

        pipeline = wds.DataPipeline(
            lambda: self._resampled(logical),
            wds.tarfile_to_samples(),
            wds.map(check_members),
            wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=buffer_rng),
            take,
            views,
            wds.batched(b, collation_fn=_stack_pairs, partial=False),
        )
        return iter(pipeline)


def _stack_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def train_loader(manifest_dir: str | Path, *, transform: TwoCropTransform, batch_size: int,
                 steps: int, epoch: int, seed: int, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, skip_batches: int = 0, shuffle_buffer: int = 2000,
                 pin_memory: bool = False) -> DataLoader:
    """Batches of two augmented views for one epoch of one rank.

    Args:
        manifest_dir: the split directory (``<shards_dir>/pretrain``).
        transform: ``transform(img, sample_seed) -> (q, k)``, each ``(C, H, W)`` float; must be
            deterministic given the seed.
        batch_size: images per batch on this rank (global batch / world size).
        steps: batches this epoch, per rank; every rank yields exactly this many.
        epoch: 0-based epoch (changes the shard draw, buffer shuffle and augmentations).
        seed: the run seed.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks.
        num_workers: DataLoader worker processes (0 = in-process).
        skip_batches: resume: yield only batches ``skip_batches..steps-1`` of this epoch.
        shuffle_buffer: samples in the shuffle buffer (raw bytes, per worker); it is filled
            before the first batch.
        pin_memory: DataLoader ``pin_memory``.

    Returns:
        A DataLoader (``len() == steps - skip_batches``) yielding ``(q, k)``, each
        ``(B, C, H, W)``.

    Raises:
        ValueError: an argument out of range (names it).
        ShardError: missing/invalid manifest; a shard missing or differing from the manifest in
            size or sha256 (at call time); a corrupt sample (during iteration).
    """
    _check_args(batch_size=(batch_size, 1), steps=(steps, 1), epoch=(epoch, 0), seed=(seed, 0),
                world_size=(world_size, 1), rank=(rank, 0), num_workers=(num_workers, 0),
                skip_batches=(skip_batches, 0), shuffle_buffer=(shuffle_buffer, 1))
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")
    if skip_batches > steps:
        raise ValueError(f"skip_batches must be <= steps ({steps}), got {skip_batches}")
    directory = Path(manifest_dir)
    manifest = read_manifest(directory)
    stream = _TrainStream(_shard_urls(directory, manifest), manifest["mode"], transform,
                          batch_size=batch_size, steps=steps, epoch=epoch, seed=seed, rank=rank,
                          world_size=world_size, skip_batches=skip_batches,
                          shuffle_buffer=shuffle_buffer)
    return _SizedLoader(stream, steps - skip_batches, num_workers, pin_memory)


class _SizedLoader(DataLoader):
    """A DataLoader over an IterableDataset that knows how many batches it yields."""

    def __init__(self, dataset: IterableDataset, length: int, num_workers: int,
                 pin_memory: bool):
        # A private generator: iterating a DataLoader draws its base seed from the generator,
        # and drawing from the GLOBAL torch RNG would shift the trainer's random stream (a
        # resumed run would then diverge from an uninterrupted one). Our streams seed
        # themselves from (seed, epoch, rank, worker), so this seed is unused.
        super().__init__(dataset, batch_size=None, num_workers=num_workers,
                         collate_fn=_identity, pin_memory=pin_memory,
                         generator=torch.Generator().manual_seed(0))
        self._length = length

    def __len__(self) -> int:
        return self._length


def _check_args(**values: tuple[int, int]) -> None:
    for name, (v, low) in values.items():
        if not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")


class _EvalStream(IterableDataset):
    """This worker's batches ``i % W == worker`` of the first ``total`` samples."""

    def __init__(self, shards: list[tuple[str, int]], mode: str, transform: EvalTransform, *,
                 batch_size: int, total: int):
        super().__init__()
        self.shards, self.mode, self.transform = shards, mode, transform
        self.batch_size, self.total = batch_size, total

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        worker, num_workers = _worker()
        b = self.batch_size
        start = 0
        pending: list[tuple[torch.Tensor, int, str]] = []
        for url, count in self.shards:
            end = min(start + count, self.total)
            if start >= end:
                break
            first_batch, last_batch = start // b, (end - 1) // b
            if not any(i % num_workers == worker for i in range(first_batch, last_batch + 1)):
                start += count
                continue
            seen = 0
            for record in iter_shard(url):
                g = start + seen  # global position in manifest order
                seen += 1
                if g >= end:
                    if end < start + count:
                        break  # max_images reached inside this shard
                    raise ShardError(f"{url}: more samples than the manifest's {count}")
                i = g // b
                if i % num_workers != worker:
                    continue
                key, image, label = decode_record(record, self.mode)
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


def eval_loader(manifest_dir: str | Path, *, transform: EvalTransform, batch_size: int,
                num_workers: int = 0, max_images: int = 0,
                pin_memory: bool = False) -> DataLoader:
    """Every sample of a split exactly once, in manifest order.

    "Deterministic order" means the order the samples were written at build time (a seeded
    shuffle of the source), identical for every ``num_workers``; the returned keys let callers
    align outputs with samples.

    Args:
        manifest_dir: the split directory (``<shards_dir>/train`` or ``/test``).
        transform: ``transform(img) -> (C, H, W)`` float tensor, deterministic.
        batch_size: images per batch; the last batch may be smaller.
        num_workers: DataLoader worker processes (0 = in-process).
        max_images: only the first ``max_images`` samples in manifest order (0 = all).
        pin_memory: DataLoader ``pin_memory``.

    Returns:
        A DataLoader (``len()`` = number of batches) yielding ``(images (B, C, H, W), labels
        (B,) int64, keys list[str] of length B)``.

    Raises:
        ValueError: an argument out of range (names it).
        ShardError: missing/invalid manifest; a shard missing or differing from the manifest in
            size or sha256 (at call time); a corrupt sample (during iteration).
    """
    _check_args(batch_size=(batch_size, 1), num_workers=(num_workers, 0),
                max_images=(max_images, 0))
    directory = Path(manifest_dir)
    manifest = read_manifest(directory)
    total = min(max_images, manifest["num_samples"]) if max_images else manifest["num_samples"]
    urls = _shard_urls(directory, manifest)
    shards = [(url, s["num_samples"]) for url, s in zip(urls, manifest["shards"], strict=True)]
    stream = _EvalStream(shards, manifest["mode"], transform, batch_size=batch_size, total=total)
    return _SizedLoader(stream, math.ceil(total / batch_size), num_workers, pin_memory)
