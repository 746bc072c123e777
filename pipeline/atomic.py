"""Atomic file writes: a temp file in the target's folder, fsync, then ``os.replace``.

A crash, a kill or a full disk in the middle of a write leaves the previous file untouched and
no half-written file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import torch


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(fileobj)`` on a temp file beside ``path``, then rename it over ``path``.

    Creates the parent folder when missing.

    Raises:
        OSError: the write failed (the temp file is removed, ``path`` is untouched).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_torch(obj: Any, path: str | Path) -> None:
    """``torch.save`` atomically (see :func:`write_atomic`).

    Raises:
        OSError: the write failed (e.g. ENOSPC); torch's zip writer reports a failed write as
            an opaque ``RuntimeError``, so the ``OSError`` underneath is re-raised instead.
    """

    def write(f: IO[bytes]) -> None:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            if isinstance(e.__context__, OSError):
                raise e.__context__ from None
            raise

    write_atomic(path, write)


def write_json(path: str | Path, obj: Any) -> None:
    """Pretty, key-sorted JSON written atomically (see :func:`write_atomic`)."""
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


def write_tsv(path: str | Path, columns: Sequence[str], rows: Iterable[dict[str, Any]]) -> None:
    """A TSV with a header row; floats as ``%.6g``, missing values empty (atomic)."""

    def fmt(v: Any) -> str:
        if v is None:
            return ""
        return f"{v:.6g}" if isinstance(v, float) else str(v)

    lines = ["\t".join(columns)] + ["\t".join(fmt(r.get(c)) for c in columns) for r in rows]
    write_atomic(path, lambda f: f.write(("\n".join(lines) + "\n").encode()))
