"""Reading a split's shards in DataLoader workers: what the train and eval loaders share.

:class:`Shard` and :func:`shard_list` turn a manifest into the shards to read, each local file
checked against the manifest's size and sha256 before anything is read; :func:`decode_any`
decodes a raw sample of either layout (ours, or a WebDataset shard read in place);
:class:`SizedLoader` is the DataLoader both loaders return, whose iterator gives a worker's
error as one line and stops its workers when closed (:func:`pipeline.data.workers.shut_down`);
its worker processes send a batch they cannot send (``/dev/shm`` full) as that error instead
(:class:`ReportingQueue`).
"""

from __future__ import annotations

import errno
import io
import multiprocessing
import multiprocessing.context
import multiprocessing.queues
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from PIL import Image
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from pipeline.data.external import image_member, open_image
from pipeline.data.manifest import LAYOUT_OWN, Manifest, ShardError
from pipeline.data.modes import to_mode
from pipeline.data.remote import ShardURL, is_url
from pipeline.data.shards import (
    IMAGE_EXTS,
    check_members,
    decode_record,
    iter_shard,
    sha256_file,
    shard_location,
)
from pipeline.data.workers import SharedMemoryError, shut_down, worker_death
from pipeline.errors import InputError


def worker_slot() -> tuple[int, int]:
    """``(worker id, workers)`` of the calling DataLoader worker; ``(0, 1)`` in-process."""
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

class Shard(NamedTuple):
    """One shard as the readers see it."""

    url: str  # path or URL
    count: int  # samples to yield (broken ones excluded)
    expect: tuple[int, str] | None  # (bytes, sha256) to check while streaming a URL
    layout: str = LAYOUT_OWN  # pipeline (png + cls, strict) | webdataset (image read, rest ignored)
    skip: frozenset[str] = frozenset()  # keys of broken samples (webdataset layout)

    def records(self) -> Iterator[dict[str, Any]]:
        """The raw samples to use, broken ones left out (a URL is read to its end)."""
        raw = iter_shard(self.url, expect=self.expect)
        return (r for r in raw if r.get("__key__") not in self.skip) if self.skip else raw


def shard_list(directory: Path | ShardURL, manifest: Manifest) -> list[Shard]:
    """The shards in manifest order (:class:`Shard`: location, samples, expect, layout).

    Local files are checked here, before any reading: each present with the manifest's byte
    size and sha256 (``expect = None``). A shard cut at a member boundary still reads as a
    valid, shorter tar, and a shard whose bytes were altered may still decode: without these
    checks a stage would silently train or evaluate on other data than the manifest (and DVC)
    describe. The sha256 of each file is computed once per process (cached by path, size and
    mtime).

    URLs are not fetched twice: ``expect = (bytes, sha256)`` travels with the URL and the
    reader checks it while streaming (:func:`pipeline.data.shards.iter_shard`).

    Raises:
        ShardError: a local shard is missing, or its size or sha256 differs from the manifest
            (names the file).
    """
    out: list[Shard] = []
    for s in manifest.shards:
        where = shard_location(directory, s)
        layout = s.read_layout
        skip = frozenset(b.key for b in s.broken or ())
        if is_url(where):
            out.append(Shard(where, s.num_samples, (s.bytes, s.sha256), layout, skip))
            continue
        path = Path(where)
        if not path.is_file():
            raise ShardError(f"{path}: shard listed in the manifest is missing")
        st = path.stat()
        if st.st_size != s.bytes:
            raise ShardError(f"{path}: {st.st_size} bytes, manifest says {s.bytes} (truncated "
                             "or altered; check with `python -m pipeline verify-shards`)")
        digest = _file_sha256(path, st.st_size, st.st_mtime_ns)
        if digest != s.sha256:
            raise ShardError(f"{path}: sha256 {digest[:16]}... != manifest {s.sha256[:16]}... "
                             "(altered; rebuild with `dvc repro -f build_shards`)")
        out.append(Shard(str(path), s.num_samples, None, layout, skip))
    return out

def open_header(data: bytes, record: dict[str, Any]) -> Image.Image:
    """The image opened by PIL, not decoded (its size, mode and format are read).

    Raises:
        ShardError: no PIL decoder reads the header (names the shard and key).
    """
    try:
        return Image.open(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 (PIL raises several types)
        raise ShardError(f"{record.get('__url__')}: sample '{record.get('__key__')}': "
                         f"undecodable image ({type(e).__name__}: {e})") from None


def image_bytes(record: dict[str, Any]) -> bytes:
    """The encoded image of a raw sample of either layout (ours: members checked first)."""
    if record.get("__layout__", LAYOUT_OWN) == LAYOUT_OWN:
        check_members(record)
        return next(record[e] for e in IMAGE_EXTS if e in record)
    return image_member(record) or b""


def decode_any(record: dict[str, Any], mode: str, *,
                reduce: Callable[[Image.Image], int] | None = None) -> Image.Image:
    """The image, in ``mode``, of a raw sample of either layout.

    Args:
        record: a raw sample; ``__layout__`` says which layout.
        mode: ``L`` or ``RGB``.
        reduce: a JPEG's DCT reduction from its header
            (:func:`pipeline.data.external.open_image`); None = full size.

    Raises:
        ShardError: the image does not decode (names the shard and key).
    """
    if record.get("__layout__", LAYOUT_OWN) == LAYOUT_OWN:
        return decode_record(record, mode, reduce=reduce)[1]
    key = str(record["__key__"])
    try:
        with open_image(image_member(record) or b"", reduce=reduce) as im:
            return to_mode(im, mode)
    except Exception as e:  # noqa: BLE001 (the index decoded it: the shard changed since)
        raise ShardError(f"{record.get('__url__')}: sample '{key}' undecodable "
                         f"({type(e).__name__}); the index found it decodable: rerun "
                         "`dvc repro`") from None


class ReportingQueue(multiprocessing.queues.Queue):
    """A multiprocessing queue whose worker sends, in place of a batch it cannot send, the error.

    A worker puts ``(index, batch)``; the queue's feeder thread pickles the batch, which moves
    its tensors into shared memory (``/dev/shm``). When that fails (``/dev/shm`` full: PyTorch's
    ``RuntimeError``), Python's queue prints the traceback and drops the batch, the worker lives
    on, and the main process waits for that index forever (pytorch/pytorch#5040). This queue
    sends ``(index, error)`` instead, as PyTorch sends a worker's exception, so the main process
    re-raises it at that batch (:meth:`SizedLoader.__iter__` names it). The same pattern as the
    standard library's ``concurrent.futures.process._SafeQueue``. A batch that fails after
    the worker closed its queue (the loader stopped at an earlier error and the worker is
    exiting) is dropped without a word: no one waits for it, and a put would raise.
    """

    def _on_queue_feeder_error(self, e: Exception, obj: Any) -> None:  # the feeder thread's hook
        if not (isinstance(obj, tuple) and len(obj) == 2) or isinstance(obj[1], ExceptionWrapper):
            super()._on_queue_feeder_error(e, obj)  # not a batch, or its error failed too
            return
        info = get_worker_info()
        where = f"in DataLoader worker process {info.id if info is not None else '?'}"
        try:
            self.put((obj[0], ExceptionWrapper((type(e), e, e.__traceback__), where=where)))
        except ValueError:  # the queue is closed: the worker is exiting, no one awaits this batch
            pass


def reporting_context() -> multiprocessing.context.BaseContext:
    """The default start method's multiprocessing context, whose queues are :class:`ReportingQueue`.

    Returns:
        A context for ``DataLoader(multiprocessing_context=...)``: processes as the default
        context's (fork on Linux), queues that report a batch they cannot send.
    """
    base = type(multiprocessing.get_context())

    def queue(self: multiprocessing.context.BaseContext, maxsize: int = 0) -> ReportingQueue:
        return ReportingQueue(maxsize, ctx=self.get_context())

    return type(f"Reporting{base.__name__}", (base,), {"Queue": queue})()


class SizedLoader(DataLoader):
    """A DataLoader over an IterableDataset that knows how many batches it yields."""

    def __init__(self, dataset: IterableDataset, length: int, num_workers: int,
                 pin_memory: bool):
        # A private generator: iterating a DataLoader draws its base seed from the generator,
        # and drawing from the GLOBAL torch RNG would shift the trainer's random stream (a
        # resumed run would then diverge from an uninterrupted one). Our streams seed
        # themselves from (seed, epoch, rank, worker), so this seed is unused.
        super().__init__(dataset, batch_size=None, num_workers=num_workers,
                         collate_fn=_identity, pin_memory=pin_memory,
                         generator=torch.Generator().manual_seed(0),
                         multiprocessing_context=reporting_context() if num_workers else None)
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[Any]:
        """Batches; a :class:`ShardError` from a worker keeps its one-line message.

        Raises:
            ShardError: a corrupt sample (the worker's one-line message).
            LoaderWorkerError: a worker process died while a batch was awaited (names the
                pid and the signal, see :mod:`pipeline.data.workers`).
            SharedMemoryError: ``/dev/shm`` had no room for a worker's batch, or for the
                queues of the workers when they start.
        """
        try:
            batches = super().__iter__()
        except OSError as e:  # the queues' semaphores (sem_open) live in /dev/shm
            if e.errno != errno.ENOSPC:
                raise
            _abandon(e)
            raise SharedMemoryError(None, item="the queues") from None
        try:
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                except ShardError as e:
                    raise ShardError(_worker_message(str(e))) from None
                except (RuntimeError, OSError, EOFError) as e:
                    died = worker_death(e, getattr(batches, "_workers", None))
                    if died is None:
                        raise
                    raise died from None
                yield batch
        finally:  # closing this generator (workers.shut_down) stops the workers now
            shut_down(batches)


def _abandon(e: BaseException) -> None:
    """Stop the workers of the iterator whose ``__init__`` raised ``e``, and mark it shut down.

    PyTorch's iterator starts each worker after creating its queue; when a queue cannot be
    created, the workers started before it are left running, and the half-built iterator's
    ``__del__`` fails on an attribute ``__init__`` never set (an "Exception ignored" traceback
    after the stage's error line). Its ``_workers`` and ``_shutdown`` are PyTorch's own, those
    its ``_shutdown_workers`` uses.
    """
    for frame, _ in traceback.walk_tb(e.__traceback__):
        batches = frame.f_locals.get("self")
        if isinstance(batches, _MultiProcessingDataLoaderIter):
            for w in getattr(batches, "_workers", ()):
                w.terminate()
                w.join()
            batches._shutdown = True


def _worker_message(text: str) -> str:
    """The original message of an exception re-raised from a DataLoader worker.

    PyTorch re-raises a multi-line text: ``Caught ShardError in DataLoader worker process 0.``,
    the worker's traceback, and last ``pipeline.data.shards.ShardError: <message>``; the stage
    should print only ``<message>`` (one line naming the shard or URL).
    """
    if not text.startswith("Caught ") or "\n" not in text:
        return text
    last = text.rstrip().splitlines()[-1]
    return last.split("ShardError: ", 1)[1] if "ShardError: " in last else last


def check_args(**values: tuple[int, int]) -> None:
    """Each ``name=(value, low)``: an int ``>= low``.

    Raises:
        InputError: the first that is not (names it).
    """
    for name, (v, low) in values.items():
        if not isinstance(v, int) or v < low:
            raise InputError(f"{name} must be an int >= {low}, got {v!r}")
