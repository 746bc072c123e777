"""Per-step schedules: every optimizer step's learning rate, precomputed (DINO/MAE hygiene)."""

from __future__ import annotations

import math


def lr_schedule(*, base_lr: float, batch_size: int, total_steps: int, steps_per_epoch: int,
                schedule: str, warmup_epochs: float = 0.0,
                milestones: list[int] | tuple[int, ...] = ()) -> list[float]:
    """The learning rate of every optimizer step.

    Args:
        base_lr: lr per 256 images; the effective lr is ``base_lr * batch_size / 256``
            (linear scaling, Goyal et al. 2017, as in MoCo).
        batch_size: global batch size (images per optimizer step).
        total_steps: optimizer steps of the whole run.
        steps_per_epoch: optimizer steps per epoch.
        schedule: ``cosine`` (half-cosine to 0, MoCo v2) or ``step`` (x0.1 at each milestone
            epoch, MoCo v1).
        warmup_epochs: linear warmup from 0 over this many epochs.
        milestones: epochs at which the step schedule multiplies the lr by 0.1.

    Returns:
        ``total_steps`` learning rates.
    """
    peak = base_lr * batch_size / 256
    warm = int(round(warmup_epochs * steps_per_epoch))
    out = []
    for s in range(total_steps):
        if s < warm:
            lr = peak * (s + 1) / warm
        elif schedule == "cosine":
            lr = peak * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total_steps - warm)))
        else:
            epoch = s / steps_per_epoch
            lr = peak * 0.1 ** sum(epoch >= m for m in milestones)
        out.append(lr)
    assert len(out) == total_steps
    return out
