"""L2 normalisation of feature rows, safe from overflow: the one used by every evaluation.

``F.normalize`` squares the entries in the input's dtype: a finite fp32 row of norm above
~1.8e19 (squares past fp32's 3.4e38) gets an infinite norm and silently becomes zeros, and a
row of tiny entries underflows. Dividing each row by its largest absolute entry first keeps
every square in ``[0, 1]``; the direction is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.errors import InputError


def l2_normalize(x: Tensor, dim: int = 1) -> Tensor:
    """Scale each row (slice along ``dim``) of ``x`` to unit L2 norm, without overflow.

    Each row is divided by its largest absolute entry (``max |x_i|``), then by its L2 norm, so
    a finite row of any magnitude (1e20 or 1e-30) gives the same unit vector as exact
    arithmetic would. An all-zero row stays zero (like ``F.normalize``); a row holding NaN or
    Inf comes out NaN, so a caller's finiteness check still sees it.

    Args:
        x: ``(N, D)`` features (any float dtype, kept); any shape with ``dim`` the feature axis.
        dim: the axis normalised (default 1: rows of an ``(N, D)`` matrix).

    Returns:
        A tensor of ``x``'s shape and dtype whose rows have L2 norm 1 (or are zero).
    """
    scale = torch.linalg.vector_norm(x, ord=float("inf"), dim=dim, keepdim=True)  # (N, 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero rows stay zero
    return F.normalize(x / scale, dim=dim)  # every |entry| <= 1 now: squares cannot overflow


def l2_normalize_rows(x: Tensor, device: torch.device | str, rows: int = 8192, *,
                      index: Tensor | None = None, error: str | None = None,
                      out: Tensor | None = None) -> Tensor:
    """:func:`l2_normalize` of an ``(N, D)`` matrix ``rows`` rows at a time, as fp32 on ``device``.

    The rows come out as the whole matrix's would (each row is normalised on its own), in one
    ``(N, D)`` fp32 tensor: ``4 N D`` bytes, where the whole-matrix call makes two more
    ``(N, D)`` temporaries (``x / scale``, then the normalised copy); ``x`` may be a
    memory-mapped feature file.

    Args:
        x: ``(N, D)`` features (any float dtype).
        device: where the result is made.
        rows: rows per block.
        index: ``(N',)`` int64 rows of ``x`` to take, in that order, gathered block by block
            (the subset is never copied whole); None: every row.
        error: when given, the message of the error raised for a row holding NaN or Inf
            (checked block by block); None: no check.
        out: an ``(N', D)`` float32 tensor on ``device`` to write into (e.g. a
            :func:`pipeline.evaluate.features.file_backed` one); None: a new one.

    Returns:
        ``(N', D)`` float32 on ``device`` (``out`` when given).

    Raises:
        ValueError: ``error``, when a row holds NaN or Inf.
    """
    n = x.shape[0] if index is None else len(index)
    if out is None:
        out = torch.empty((n, *x.shape[1:]), dtype=torch.float32, device=device)  # N' x D
    for r0 in range(0, n, rows):
        block = x[r0 : r0 + rows] if index is None else x[index[r0 : r0 + rows]]
        chunk = l2_normalize(block.to(device, torch.float32))  # rows x D
        if error is not None and not torch.isfinite(chunk).all():  # per block: few temporaries
            raise InputError(error)
        out[r0 : r0 + rows] = chunk
    return out
