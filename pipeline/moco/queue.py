"""The MoCo dictionary: a FIFO queue of the K most recent keys (He et al., CVPR 2020, Sec. 3.2).

The queue is a ring buffer of persistent buffers (saved with the model, restored on resume):

* ``keys``: ``(D, K)`` float32, one key per column. At construction every column is a random
  unit vector, as in the reference implementation, so the first steps contrast against noise.
* ``ptr``: 0-dim long, the slot the next key goes to (= the oldest key once the queue is full).
* ``written_step``: ``(K,)`` long, the training step each slot was last written at; ``-1`` for
  slots that still hold the random initial keys.

Reading the logical FIFO order (oldest first) is ``keys.roll(-ptr, dims=1)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import InputError


class KeyQueue(nn.Module):
    """FIFO dictionary of the ``K`` most recent keys, stored in place as a ``(D, K)`` ring buffer.

    Args:
        dim: key dimension ``D`` (128 in MoCo v1/v2).
        K: number of keys (65536 in MoCo v1/v2, 4096 in the MoCo CIFAR-10 demo).
        generator: optional RNG for the random initial keys (default: the global torch RNG).

    Raises:
        ValueError: ``dim < 1`` or ``K < 1``.
    """

    keys: torch.Tensor
    ptr: torch.Tensor
    written_step: torch.Tensor

    def __init__(self, dim: int, K: int, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if dim < 1:
            raise InputError(f"KeyQueue: dim (model.dim) must be >= 1, got {dim}")
        if K < 1:
            raise InputError(f"KeyQueue: K (moco.K) must be >= 1, got {K}")
        init = F.normalize(torch.randn(dim, K, generator=generator), dim=0)  # unit columns
        self.register_buffer("keys", init.float())  # (D, K)
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("written_step", torch.full((K,), -1, dtype=torch.long))

    @property
    def dim(self) -> int:
        """Key dimension ``D``."""
        return self.keys.shape[0]

    @property
    def K(self) -> int:  # noqa: N802 - the paper's name
        """Number of slots ``K``."""
        return self.keys.shape[1]

    def negatives(self) -> torch.Tensor:
        """A snapshot of the current keys, to contrast against BEFORE this step's enqueue.

        A copy is returned (as the reference's ``queue.clone().detach()``): autograd keeps the
        negatives for the gradient of ``q``, and :meth:`enqueue` later overwrites the buffer in
        place, which would otherwise invalidate the saved tensor.

        Returns:
            ``(D, K)`` float32 tensor on the queue's device, no gradient.
        """
        return self.keys.detach().clone()

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor, step: int) -> None:
        """Write ``keys`` into the oldest slots (dequeue and enqueue in one in-place write).

        Equivalent to writing the keys one by one in batch order, each at ``ptr`` and then
        advancing ``ptr`` by one modulo ``K``: any ``N`` works (``N`` need not divide ``K``; the
        write wraps around). With ``N > K`` only the last ``K`` keys are kept, so the queue still
        holds the ``K`` most recent keys in order. No memory is allocated for the buffer and the
        pointer is updated on the device (no host synchronisation).

        Args:
            keys: ``(N, D)`` keys (any float dtype; stored as float32), normally L2-normalised
                and gathered from all ranks.
            step: the training step (optimizer steps) recorded in ``written_step``.

        Raises:
            ValueError: ``keys`` is not 2-D with ``D`` columns.
        """
        if keys.ndim != 2 or keys.shape[1] != self.dim:
            raise InputError(
                f"KeyQueue.enqueue: expected keys of shape (N, {self.dim}), got {tuple(keys.shape)}"
            )
        n = keys.shape[0]
        if n == 0:
            return
        kept = keys[-self.K :] if n > self.K else keys  # (min(N, K), D): the most recent keys
        offset = n - kept.shape[0]  # keys that would be overwritten within this same batch
        arange = torch.arange(kept.shape[0], device=self.keys.device)
        slots = (self.ptr + offset + arange) % self.K  # (min(N, K),) distinct slots
        self.keys.index_copy_(1, slots, kept.detach().t().to(self.keys))
        self.written_step.index_fill_(0, slots, int(step))
        self.ptr.add_(n).remainder_(self.K)

    @torch.no_grad()
    def filled(self) -> float:
        """Fraction of slots that hold real keys (not the random initial ones), in [0, 1]."""
        return float((self.written_step >= 0).float().mean())

    @torch.no_grad()
    def mean_age(self, step: int) -> float:
        """Mean age of the real keys, in training steps: ``mean(step - written_step)``.

        Only slots written at least once count. Returns ``nan`` when no slot has been written
        yet (an age of "nothing" is undefined; ``nan`` is not mistaken for fresh keys).

        Args:
            step: the current training step.
        """
        written = self.written_step >= 0
        if not bool(written.any()):
            return math.nan
        return float((step - self.written_step[written]).double().mean())

    def extra_repr(self) -> str:
        """Extra text for ``repr``: ``dim`` and ``K``."""
        return f"dim={self.dim}, K={self.K}"
