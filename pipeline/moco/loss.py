"""InfoNCE, the contrastive loss of MoCo (He et al., CVPR 2020, Eq. 1), and instance accuracy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.errors import InputError


def info_nce(
    q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, T: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """InfoNCE of each query against its positive key and the queue's negatives.

    ``L = −log exp(q·k₊/T) / (exp(q·k₊/T) + Σᵢ exp(q·kᵢ/T))``, averaged over the batch: a
    (1+K)-way softmax classifier whose correct class is the positive, at index 0.

    The logits are computed in float32 even under autocast (inputs are cast to float32 and
    autocast is disabled around the products): with ``T = 0.07`` a bf16 cosine (8-bit mantissa)
    would be off by up to ~0.06 in the logits.

    Args:
        q: ``(N, D)`` queries, expected L2-normalised (gradient flows through them).
        k: ``(N, D)`` positive keys, expected L2-normalised, row ``i`` pairs with ``q[i]``
            (normally without gradient).
        queue: ``(D, K)`` negative keys, read BEFORE this step's keys are enqueued.
        T: softmax temperature > 0 (0.07 MoCo v1, 0.2 MoCo v2, 0.1 MoCo CIFAR-10 demo).

    Returns:
        ``(loss, logits)``: the scalar float32 mean loss and the ``(N, 1 + K)`` float32 logits
        (already divided by ``T``; column 0 is the positive).

    Raises:
        ValueError: mismatched shapes or ``T <= 0``.
    """
    if q.ndim != 2 or q.shape != k.shape:
        raise InputError(
            f"info_nce: q and k must both be (N, D); got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if queue.ndim != 2 or queue.shape[0] != q.shape[1]:
        raise InputError(f"info_nce: queue must be (D={q.shape[1]}, K); got {tuple(queue.shape)}")
    if not T > 0:
        raise InputError(f"info_nce: temperature T (moco.T) must be > 0, got {T}")
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, queue = q.float(), k.float(), queue.float()
        l_pos = (q * k).sum(dim=1, keepdim=True)  # (N, 1)
        l_neg = q @ queue  # (N, K)
        logits = torch.cat([l_pos, l_neg], dim=1) / T  # (N, 1 + K)
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        loss = F.cross_entropy(logits, labels)
    return loss, logits


@torch.no_grad()
def instance_accuracy(
    logits: torch.Tensor, topk: tuple[int, ...] = (1, 5)
) -> tuple[torch.Tensor, ...]:
    """Instance-discrimination accuracy: how often the positive (column 0) ranks in the top-k.

    Early in training this can look perfect against the random initial queue: not a bug.

    Args:
        logits: ``(N, 1 + K)`` logits with the positive at column 0.
        topk: the k values; a k larger than ``1 + K`` is clamped to ``1 + K`` (then 100 %).

    Returns:
        One 0-dim float32 tensor per k, in percent (0–100), on the logits' device (no host
        synchronisation; call ``.item()`` when logging).

    Raises:
        ValueError: ``logits`` is not 2-D, or a k is < 1.
    """
    if logits.ndim != 2:
        raise InputError(f"instance_accuracy: logits must be (N, 1 + K), got {tuple(logits.shape)}")
    if any(k < 1 for k in topk):
        raise InputError(f"instance_accuracy: every k must be >= 1, got {topk}")
    kmax = min(max(topk), logits.shape[1])
    ranked = logits.topk(kmax, dim=1).indices  # (N, kmax)
    hit = ranked == 0  # (N, kmax), at most one True per row
    out = []
    for k in topk:
        kk = min(k, logits.shape[1])
        out.append(hit[:, :kk].any(dim=1).float().mean() * 100.0)
    return tuple(out)
