"""Shard locations that are URLs: joining, and byte streams with retries and a running sha256.

``data.shards_dir`` is a local directory or a URL: ``http(s)://…`` (read with the standard
library) or any other ``scheme://…`` that `fsspec <https://filesystem-spec.readthedocs.io>`_
understands (``s3://`` needs ``s3fs``, ``gs://`` needs ``gcsfs``; ``file://`` always works).
:func:`shards_location` turns the param into a :class:`~pathlib.Path` or a :class:`ShardURL`;
both join with ``/`` (``shards_location(p.data.shards_dir) / "pretrain"``), so code written
for directories works unchanged for URLs.

:func:`open_stream` reads a URL front to back. Transient failures (connection refused or reset,
timeouts, HTTP 408/425/429/5xx, a body shorter than its ``Content-Length``) are retried up to
``RETRIES`` times with exponential backoff, resuming at the byte reached (HTTP ``Range``, or
re-reading and discarding the prefix when the server ignores it); a permanent failure (HTTP
404, 403, …, a missing fsspec object) fails at once. Either way :class:`RemoteError` carries
one line naming the URL.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import re
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["RemoteError", "ShardURL", "is_url", "open_stream", "read_url", "shards_location"]

RETRIES = 5  # attempts after the first failure of one read (per failure episode)
BACKOFF_S = 0.5  # first wait; doubled after each failed attempt, capped at BACKOFF_MAX_S
BACKOFF_MAX_S = 8.0
TIMEOUT_S = 60.0  # socket timeout of one HTTP request (connect and each read), seconds
TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_CHUNK = 1 << 20


class RemoteError(Exception):
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
            raise ValueError(f"not a URL (scheme://...): {url!r}")
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


class _Transient(Exception):
    """A failure worth retrying (internal)."""


class _Stream(io.RawIOBase):
    """Read-only raw stream over a URL with resume-on-failure, byte count and sha256."""

    def __init__(self, url: str, *, retries: int, timeout: float) -> None:
        super().__init__()
        self.url, self.retries, self.timeout = url, retries, timeout
        self.pos = 0  # bytes delivered so far
        self.sha256 = hashlib.sha256()
        self._f: Any = None
        self._end: int | None = None  # expected total length when the server said so
        self._retrying(self._open)

    # --- opening -------------------------------------------------------------------------
    def _open(self) -> None:
        self._close_f()
        if self.url.split("://", 1)[0].lower() in ("http", "https"):
            self._open_http()
        else:
            self._open_fsspec()

    def _open_http(self) -> None:
        headers = {"Range": f"bytes={self.pos}-"} if self.pos else {}
        req = urllib.request.Request(self.url, headers=headers)
        try:
            f = urllib.request.urlopen(req, timeout=self.timeout)  # noqa: S310 (http(s) only)
        except urllib.error.HTTPError as e:
            e.close()
            if e.code in TRANSIENT_HTTP:
                raise _Transient(f"HTTP {e.code} {e.reason}") from None
            raise RemoteError(f"{self.url}: HTTP {e.code} {e.reason}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, ssl.SSLCertVerificationError):  # not going to get better
                raise RemoteError(f"{self.url}: {_why(e)}") from None
            raise _Transient(_why(e)) from None
        except (OSError, http.client.HTTPException) as e:
            raise _Transient(_why(e)) from None
        length = f.headers.get("Content-Length")
        try:
            if self.pos and f.status == 206:
                start = self.pos
            else:  # the whole body again: skip what was already delivered
                start = 0
                left = self.pos
                while left:
                    got = f.read(min(left, _CHUNK))
                    if not got:
                        raise _Transient("body shorter than before on reconnect")
                    left -= len(got)
        except (OSError, http.client.HTTPException) as e:
            f.close()
            raise _Transient(_why(e)) from None
        self._end = start + int(length) if length and length.isdigit() else None
        self._f = f

    def _open_fsspec(self) -> None:
        try:
            import fsspec

            f = fsspec.open(self.url, "rb").open()
        except (FileNotFoundError, PermissionError, ImportError, ValueError) as e:
            raise RemoteError(f"{self.url}: {_why(e)}") from None
        except OSError as e:
            raise _Transient(_why(e)) from None
        if self.pos:
            try:
                f.seek(self.pos)
            except OSError as e:
                f.close()
                raise _Transient(_why(e)) from None
        self._f, self._end = f, None

    # --- reading -------------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._retrying(lambda: self._read(len(b)))
        n = len(data)
        b[:n] = data
        return n

    def _read(self, n: int) -> bytes:
        try:
            data = self._f.read(n)
        except (OSError, http.client.HTTPException) as e:  # reset, timeout, IncompleteRead
            raise _Transient(_why(e)) from None
        if not data and self._end is not None and self.pos < self._end:
            raise _Transient(f"connection closed at byte {self.pos} of {self._end}")
        self.pos += len(data)
        self.sha256.update(data)
        return data

    def _retrying(self, fn: Any) -> Any:
        for attempt in range(self.retries + 1):
            try:
                if self._f is None and fn != self._open:
                    self._open()
                return fn()
            except _Transient as e:
                self._close_f()
                if attempt == self.retries:
                    raise RemoteError(f"{self.url}: {e} (gave up after {self.retries + 1} "
                                      "attempts)") from None
                time.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

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


def _why(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError):
        e = e.reason if isinstance(e.reason, BaseException) else e
    if isinstance(e, socket.timeout | TimeoutError):
        return "timed out"
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def open_stream(url: str | ShardURL, *, retries: int | None = None,
                timeout: float = TIMEOUT_S) -> _Stream:
    """Open a URL for sequential reading; ``.pos`` and ``.sha256`` follow the bytes read.

    Args:
        url: ``http(s)://`` or an fsspec URL.
        retries: attempts after a transient failure (default :data:`RETRIES`).
        timeout: socket timeout per HTTP request, in seconds.

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
        out = bytearray()
        while chunk := f.read(_CHUNK):
            out += chunk
    return bytes(out)
