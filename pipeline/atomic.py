"""Atomic file writes: a temp file in the target's folder, fsync, then ``os.replace``.

A crash, a kill or a full disk in the middle of a write leaves the previous file untouched and
no half-written file behind. :func:`read_json` is the matching lenient read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# Metric names holding an accuracy in percent (top1, knn_top5, train_acc, accuracy, ...).
_PERCENT = re.compile(r"(^|_)(top\d+|acc|accuracy)($|_)")
PERCENT_DECIMALS = 2  # 0.01 pt: the resolution of an accuracy over 10,000 test images
SIGNIFICANT_DIGITS = 6  # other floats (loss, lr, seconds, images/s): like write_tsv's %.6g
log = logging.getLogger(__name__)


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
    import torch  # lazy: the stage entry points import this module before torch

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


def read_json(path: str | Path, *, unreadable: str = "treated as not available"
              ) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None when the file is missing or not a JSON object.

    Args:
        path: the file.
        unreadable: what happens instead, logged with the path and the error when the file
            exists but cannot be read or parsed.
    """
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("cannot read %s (%s); %s", path, e, unreadable)
        return None
    return obj if isinstance(obj, dict) else None


def round_metric(name: str, value: Any) -> Any:
    """A metric value rounded to the precision it carries (non-floats unchanged).

    Accuracies in percent (a name with ``top<k>``, ``acc`` or ``accuracy`` as a ``_``-separated
    part) to 0.01 pt; other finite floats to 6 significant digits. ``79.32000000000001`` becomes
    ``79.32``, ``1239.4556381702423`` becomes ``1239.46``.

    Args:
        name: the metric's key (its last part decides the rule).
        value: any JSON value.
    """
    if not isinstance(value, float) or not math.isfinite(value):
        return value
    if _PERCENT.search(name.lower()):
        return round(value, PERCENT_DECIMALS)
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}")


def round_metrics(obj: Any, name: str = "") -> Any:
    """:func:`round_metric` applied to every float in a (nested) dict/list by its key."""
    if isinstance(obj, dict):
        return {k: round_metrics(v, str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [round_metrics(v, name) for v in obj]
    return round_metric(name, obj)


def write_metrics(path: str | Path, metrics: Any) -> Any:
    """A metrics JSON file, floats rounded by :func:`round_metrics`, written atomically.

    Returns:
        The rounded object, as written (log this one, so MLflow shows the same numbers).
    """
    rounded = round_metrics(metrics)
    write_json(path, rounded)
    return rounded


def headline(metrics: Mapping[str, Any], names: Iterable[str] | Mapping[str, str]
             ) -> dict[str, Any]:
    """The few numbers of a stage that ``metrics/<stage>.json`` holds, of all it measured.

    ``eval/metrics/<stage>.json`` keeps every number; ``metrics/<stage>.json``, the file that
    ``dvc exp show``, ``dvc metrics show`` and ``python -m pipeline compare`` display, only
    these (docs/tracking.md, "Metrics": why so few).

    Args:
        metrics: every number of the stage.
        names: the keys kept, in order; a mapping renames (headline name -> key in ``metrics``).

    Returns:
        ``{name: metrics[key]}`` for the keys present: a number the stage computes only with
        some params (``val_top1`` without a validation split) is left out.
    """
    pairs = names.items() if isinstance(names, Mapping) else ((n, n) for n in names)
    return {name: metrics[key] for name, key in pairs if key in metrics}


def write_tsv(path: str | Path, columns: Sequence[str], rows: Iterable[dict[str, Any]]) -> None:
    """A TSV with a header row; floats as ``%.6g``, a missing value as ``NaN`` (atomic).

    ``NaN``, not an empty cell: ``dvc plots show`` draws an empty cell at 0 (the linear probe's
    test accuracy of augment mode, known at the last epoch only, was a line from 0), and leaves
    a ``NaN`` point out; numpy and pandas read it as nan.
    """

    def fmt(v: Any) -> str:
        if v is None:
            return "NaN"
        return f"{v:.6g}" if isinstance(v, float) else str(v)

    lines = ["\t".join(columns)] + ["\t".join(fmt(r.get(c)) for c in columns) for r in rows]
    write_atomic(path, lambda f: f.write(("\n".join(lines) + "\n").encode()))
