"""Encoding a split's samples on every core, handed back in order: the bytes of its shards.

Per image, ``build_shards`` encodes it (PNG or JPEG, :func:`~pipeline.data.encode.encode_member`),
takes its pixel sums (:func:`~pipeline.data.manifest.pixel_sums`) and writes its tar headers:
for Fashion-MNIST about 40, 15 and 40 % of the time (cProfile), all per image and independent.
:class:`EncodePool` sends chunks of samples to ``data.build_workers`` processes and yields each
sample's finished tar members in the samples' own order; the main process reads the source,
checks each sample and writes the bytes. A worker runs exactly what one process runs
(:func:`encode_chunk`), so the shards are byte-identical for any number of workers.

The tar members are those of Python's ``tarfile`` writing a ``w|`` stream (what webdataset's
``TarWriter`` uses, with the fixed header of :data:`TAR_OPTIONS`): the header block(s) of
``TarInfo.tobuf`` in ``tarfile``'s default format and encoding, the data, NUL padding to a
512-byte block; :func:`tar_end` is what ``TarFile.close`` appends.

Memory: at most :data:`MAX_PIXELS_IN_FLIGHT` pixels (and 2 chunks per worker) are on their way
at once, so a folder of 60 MP photos holds a few of them, not the whole folder.
"""

from __future__ import annotations

import tarfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
from PIL import Image

from pipeline.cores import process_pool
from pipeline.data.encode import encode_member
from pipeline.data.manifest import pixel_sums
from pipeline.data.shards import LABEL_EXT
from pipeline.data.sources import Sample

TAR_OPTIONS = {"mtime": 0, "uname": "moco", "gname": "moco", "mode": 0o444}  # every member
_BLOCK, _RECORD = tarfile.BLOCKSIZE, tarfile.RECORDSIZE
CHUNK_PIXELS = 1 << 20  # samples are sent to a worker in chunks of about a megapixel
CHUNK_SAMPLES = 512  # ... and at most this many (Fashion-MNIST: 512 images of 784 pixels)
MAX_PIXELS_IN_FLIGHT = 1 << 27  # 134 MP: ~0.4 GB of RGB pixels sent and not yet written


@dataclass(frozen=True)
class Encoded:
    """A chunk of samples as they go into the shards.

    Attributes:
        members: per sample, its tar members (headers, data, padding) in sorted extension
            order.
        kinds: per sample, how its image was stored (:data:`pipeline.data.encode.MEMBER_KINDS`).
        sums: ``(C,)`` sums of the chunk's pixel values (0..255); ``squares`` of their squares.
        pixels: the chunk's pixels per channel.
    """

    members: list[bytes]
    kinds: list[str]
    sums: tuple[int, ...]
    squares: tuple[int, ...]
    pixels: int


def tar_member(name: str, data: bytes) -> bytes:
    """One tar member as ``tarfile.TarFile.addfile`` writes it: header, data, NUL padding."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for field_name, value in TAR_OPTIONS.items():
        setattr(info, field_name, value)
    header = info.tobuf(tarfile.DEFAULT_FORMAT, tarfile.ENCODING, "surrogateescape")
    return header + data + bytes(-len(data) % _BLOCK)


def tar_end(size: int) -> bytes:
    """What ``TarFile.close`` appends to ``size`` bytes of members (NULs to a 10240-B record)."""
    return bytes(2 * _BLOCK + (-(size + 2 * _BLOCK) % _RECORD))


def encode_chunk(samples: list[Sample], shard_format: str) -> Encoded:
    """Encode samples as tar members and sum their pixels (what a worker runs).

    Args:
        samples: checked samples (:class:`~pipeline.data.build._SplitStats`), all of one mode.
        shard_format: ``auto``, ``png`` or ``jpeg`` (``data.shard_format``).

    Returns:
        The chunk, its samples in order (:class:`Encoded`).
    """
    members, kinds = [], []
    sums = squares = 0
    pixels = 0
    for s in samples:
        ext, data, kind = encode_member(s, shard_format)
        files = {ext: data, LABEL_EXT: str(int(s.label)).encode("ascii")}
        members.append(b"".join(tar_member(f"{s.key}.{m}", files[m]) for m in sorted(files)))
        kinds.append(kind)
        one_sums, one_squares, one_pixels = pixel_sums(s.image)
        sums, squares, pixels = sums + one_sums, squares + one_squares, pixels + one_pixels
    return Encoded(members, kinds, tuple(int(v) for v in np.atleast_1d(sums)),
                   tuple(int(v) for v in np.atleast_1d(squares)), pixels)


def _packed(samples: list[Sample]) -> list[tuple]:
    """Samples as plain values: pickled several times faster than PIL images."""
    return [(s.key, s.label, s.image.mode, s.image.size, s.image.tobytes(), s.file)
            for s in samples]


def encode_packed(packed: list[tuple], shard_format: str) -> Encoded:
    """:func:`encode_chunk` of :func:`_packed` samples (what a worker process runs)."""
    return encode_chunk([Sample(key, Image.frombytes(mode, size, raw), label, file)
                         for key, label, mode, size, raw, file in packed], shard_format)


def _pixels(s: Sample) -> int:
    w, h = s.image.size
    return w * h


class EncodePool:
    """``workers`` processes that encode samples (:func:`encode_chunk`), results in order.

    One process (``workers`` 1) encodes in the calling process, and so does a split of a single
    chunk: the processes start at the second chunk, then serve every later split. Use as a
    context manager (the processes end at its exit).

    Args:
        workers: processes (``data.build_workers``; ``auto`` is resolved by the caller).
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> EncodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def _submit(self, chunk: list[Sample], shard_format: str,
                inline: bool) -> Future[Encoded]:
        if inline:  # the first chunk, or one process: no pickling, no start-up
            done: Future[Encoded] = Future()
            done.set_result(encode_chunk(chunk, shard_format))
            return done
        if self._executor is None:
            self._executor = process_pool(self.workers)
        return self._executor.submit(encode_packed, _packed(chunk), shard_format)

    def encode(self, samples: Iterable[Sample], shard_format: str,
               check: Callable[[int, Sample], None]) -> Iterator[Encoded]:
        """Encode every sample; yield them in order, in chunks.

        Args:
            samples: the split's samples, in the order they are stored.
            shard_format: ``data.shard_format``.
            check: called on each sample (its index, the sample) before it is sent; it
                raises to refuse a sample (nothing after it is encoded).

        Yields:
            :class:`Encoded` chunks, in the samples' order.
        """
        pending: deque[tuple[Future[Encoded], int]] = deque()
        in_flight = 0
        chunk: list[Sample] = []
        chunk_pixels = chunks = 0
        n = 0
        for s in samples:
            check(n, s)
            n += 1
            chunk.append(s)
            chunk_pixels += _pixels(s)
            del s  # the chunk holds it until it is sent
            if chunk_pixels < CHUNK_PIXELS and len(chunk) < CHUNK_SAMPLES:
                continue
            while pending and (len(pending) >= 2 * self.workers
                               or in_flight + chunk_pixels > MAX_PIXELS_IN_FLIGHT):
                future, px = pending.popleft()
                in_flight -= px
                yield future.result()
            pending.append((self._submit(chunk, shard_format, self.workers == 1 or chunks == 0),
                            chunk_pixels))
            in_flight += chunk_pixels
            chunk, chunk_pixels, chunks = [], 0, chunks + 1
        if chunk:
            pending.append((self._submit(chunk, shard_format, self.workers == 1 or chunks == 0),
                            chunk_pixels))
        del chunk
        while pending:
            yield pending.popleft()[0].result()
