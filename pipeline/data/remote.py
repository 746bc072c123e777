"""Shard locations that are URLs: joining, and byte streams with retries and a running sha256.

``data.shards_dir`` is a local directory or a URL that `fsspec
<https://filesystem-spec.readthedocs.io>`_ understands: ``http(s)://`` (aiohttp, installed with
fsspec's ``http`` extra), ``s3://`` (needs ``s3fs``), ``gs://`` (``gcsfs``), ``file://``.
:func:`shards_location` turns the param into a :class:`~pathlib.Path` or a :class:`ShardURL`;
both join with ``/`` (``shards_location(p.data.shards_dir) / "pretrain"``), so code written
for directories works unchanged for URLs.

:func:`open_stream` reads a URL front to back through fsspec (HTTP in streaming mode,
``block_size=0``). Transient failures (connection refused or reset, timeouts, HTTP
408/425/429/5xx, a body shorter than its ``Content-Length``) are retried up to ``RETRIES``
times with exponential backoff, resuming at the byte reached; a permanent failure (HTTP 404,
403, ..., a missing object, a missing fsspec backend) fails at once. Either way
:class:`RemoteError` carries one line naming the URL.

What fsspec 2026.9 does not do, and this module therefore does itself (measured against a
local server, see ``tests/data/test_remote.py``):

- Retry. ``HTTPFileSystem`` has no retry loop; a 503, a reset or a cut body raises once.
- Resume. The streaming file cannot seek, so a retry reopens with ``Range: bytes=<pos>-`` and,
  when the server ignores it (200 instead of 206, as ``python -m http.server`` does), reads
  and discards the prefix. Other schemes reopen and ``seek``.
- Tell a 404 from a 503 or a dead server. Opening an HTTP URL first asks ``info()`` (HEAD, then
  GET), which turns every failure into ``FileNotFoundError(url)``; the real cause (an
  ``aiohttp.ClientResponseError`` with the status, a ``ClientConnectorError``, ...) is its
  ``__cause__``, and that decides.
- Hash. The running byte count and sha256 follow the bytes delivered.

fsspec (aiohttp) does detect a body shorter than its ``Content-Length`` (``ClientPayloadError``,
also for a reset mid-body); a body without ``Content-Length`` cut early reads as a short file,
which the manifest's byte count catches. aiohttp's default 5-minute total timeout would end any
long download, so the session has none; :data:`TIMEOUT_S` bounds connecting and each read.
"""

from __future__ import annotations

import hashlib
import io
import re
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pipeline.errors import InputError, PipelineError

__all__ = ["RemoteError", "ShardURL", "is_transient", "is_url", "open_stream", "read_url",
           "retry_transient", "shards_location"]

RETRIES = 5  # attempts after the first failure of one read (per failure episode)
BACKOFF_S = 0.5  # first wait; doubled after each failed attempt, capped at BACKOFF_MAX_S
BACKOFF_MAX_S = 8.0
TIMEOUT_S = 60.0  # HTTP: connecting, and each read of the body, seconds
TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_CHUNK = 1 << 20
T = TypeVar("T")


class RemoteError(PipelineError):
    """A URL could not be read; the message is one line that names the URL.

    ``str()`` stays that line even when a library appends to ``args`` on the way up
    (webdataset's tar iterators do).
    """

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line

    def __str__(self) -> str:
        return self.line


class ShardURL:
    """A URL that joins like a path: ``ShardURL("https://h/shards") / "pretrain"``.

    Deliberately not :class:`os.PathLike`: passing it to ``open()`` or ``Path()`` fails loudly
    instead of collapsing ``//``.
    """

    __slots__ = ("url",)

    def __init__(self, url: str) -> None:
        if not _URL_RE.match(url):
            raise InputError(f"not a URL (scheme://...): {url!r}")
        self.url = url.rstrip("/")

    def __truediv__(self, name: str | Path) -> ShardURL:
        return ShardURL(f"{self.url}/{str(name).strip('/')}")

    @property
    def name(self) -> str:
        """The last path segment (like :attr:`pathlib.PurePath.name`)."""
        return self.url.rsplit("/", 1)[-1]

    @property
    def scheme(self) -> str:
        """``http``, ``https``, ``s3``, ..."""
        return self.url.split("://", 1)[0].lower()

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ShardURL({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardURL) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)


def is_url(location: Any) -> bool:
    """True for a :class:`ShardURL` or a string of the form ``scheme://...``."""
    return isinstance(location, ShardURL) or (isinstance(location, str)
                                              and bool(_URL_RE.match(location)))


def shards_location(location: str | Path | ShardURL) -> Path | ShardURL:
    """``data.shards_dir`` (or a split under it) as something that joins with ``/``.

    Args:
        location: a local path or a URL (``http(s)://``, ``s3://``, ``file://``, ...).

    Returns:
        A :class:`ShardURL` for a URL, else a :class:`~pathlib.Path`.
    """
    if isinstance(location, ShardURL | Path):
        return location
    return ShardURL(location) if is_url(location) else Path(location)


def _backoff(attempt: int) -> float:
    return min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt)


def _failure(e: BaseException) -> tuple[bool, str] | None:
    """``(transient, one-line reason)`` for an I/O failure; None for anything else (a bug)."""
    import aiohttp

    if isinstance(e, FileNotFoundError) and isinstance(e.__cause__, aiohttp.ClientError | OSError):
        e = e.__cause__  # fsspec's HTTP info() wraps every failure in FileNotFoundError(url)
    if isinstance(e, aiohttp.ClientResponseError):
        return e.status in TRANSIENT_HTTP, f"HTTP {e.status} {e.message}"
    permanent = (FileNotFoundError, PermissionError, ImportError, ValueError,
                 aiohttp.ClientConnectorCertificateError, ssl.SSLCertVerificationError)
    if isinstance(e, permanent):
        return False, _why(e)
    if isinstance(e, OSError | aiohttp.ClientError | EOFError):  # resets, timeouts, cut bodies
        return True, _why(e)
    return None


def _why(e: BaseException) -> str:
    if isinstance(e, TimeoutError):  # also fsspec's FSTimeoutError, aiohttp's socket timeouts
        return "timed out"
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def is_transient(e: BaseException) -> bool:
    """Whether an I/O failure is worth another attempt.

    Transient: connection refused or reset, a timeout, HTTP 408/425/429/5xx, a cut body; also
    when fsspec's HTTP ``info()`` wrapped it in ``FileNotFoundError``.
    """
    failure = _failure(e)
    return failure is not None and failure[0]


def retry_transient(fn: Callable[[], T], *, retries: int | None = None,
                    cleanup: Callable[[], None] | None = None) -> T:
    """``fn()``, called again after each transient failure (:func:`is_transient`), with backoff.

    The waits are :data:`BACKOFF_S`, doubled per attempt up to :data:`BACKOFF_MAX_S`.

    Args:
        fn: one attempt (a read, a HEAD, a listing).
        retries: attempts after the first failure (default :data:`RETRIES`, read when called).
        cleanup: called after every failed attempt (e.g. closing a broken connection).

    Raises:
        Exception: a permanent failure at once, or the last transient one after ``retries``
            more attempts; unchanged, so the caller words the message.
    """
    retries = RETRIES if retries is None else retries
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:
            if cleanup is not None:
                cleanup()
            if attempt == retries or not is_transient(e):
                raise
            time.sleep(_backoff(attempt))
    raise AssertionError("unreachable")


class _Stream(io.RawIOBase):
    """Read-only raw stream over a URL with resume-on-failure, byte count and sha256."""

    def __init__(self, url: str, *, retries: int, timeout: float) -> None:
        super().__init__()
        self.url, self.retries, self.timeout = url, retries, timeout
        self.pos = 0  # bytes delivered so far
        self.sha256 = hashlib.sha256()
        self._f: Any = None
        self._retrying(lambda: None)  # open now: a 404 fails here, not at the first read

    def _open(self) -> None:
        import fsspec

        if self.url.split("://", 1)[0].lower() in ("http", "https"):
            import aiohttp

            fs = fsspec.filesystem("http", client_kwargs={"timeout": aiohttp.ClientTimeout(
                total=None, sock_connect=self.timeout, sock_read=self.timeout)})
            headers = {"Range": f"bytes={self.pos}-"} if self.pos else {}
            self._f = fs.open(self.url, "rb", block_size=0, headers=headers)
            skip = 0 if self._f.r.status == 206 else self.pos  # .r: the aiohttp response
        else:
            fs, path = fsspec.url_to_fs(self.url)
            self._f = fs.open(path, "rb")
            self._f.seek(self.pos)
            skip = 0
        while skip:  # the whole body again: drop what was already delivered
            got = self._f.read(min(skip, _CHUNK))
            if not got:
                raise EOFError("body shorter than before on reconnect")
            skip -= len(got)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._retrying(lambda: self._f.read(len(b)))
        n = len(data)
        b[:n] = data
        self.pos += n
        self.sha256.update(data)
        return n

    def _retrying(self, fn: Any) -> Any:
        def attempt() -> Any:
            if self._f is None:
                self._open()
            return fn()

        try:
            return retry_transient(attempt, retries=self.retries, cleanup=self._close_f)
        except Exception as e:  # noqa: BLE001 (classified by _failure; others re-raised)
            failure = _failure(e)
            if failure is None:
                raise
            transient, why = failure
            tail = f" (gave up after {self.retries + 1} attempts)" if transient else ""
            raise RemoteError(f"{self.url}: {why}{tail}") from None

    def _close_f(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except Exception:  # noqa: BLE001 (closing a broken connection)
                pass
            self._f = None

    def close(self) -> None:
        self._close_f()
        super().close()


def open_stream(url: str | ShardURL, *, retries: int | None = None,
                timeout: float = TIMEOUT_S) -> _Stream:
    """Open a URL for sequential reading; ``.pos`` and ``.sha256`` follow the bytes read.

    Args:
        url: an ``http(s)://`` or other fsspec URL.
        retries: attempts after a transient failure (default :data:`RETRIES`).
        timeout: HTTP only: the limit for connecting and for each read, in seconds (default
            :data:`TIMEOUT_S`).

    Returns:
        A raw binary stream (wrap it in :class:`io.BufferedReader` for small reads).

    Raises:
        RemoteError: a permanent failure, or a transient one that outlived the retries.
    """
    return _Stream(str(url), retries=RETRIES if retries is None else retries, timeout=timeout)


def read_url(url: str | ShardURL) -> bytes:
    """The whole content of a (small) URL, e.g. a ``manifest.json``.

    Raises:
        RemoteError: as :func:`open_stream`.
    """
    with open_stream(url) as f:
        return f.readall()
