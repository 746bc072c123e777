"""Per-step learning-rate schedules, precomputed (DINO/MAE hygiene): pretraining and the probe.

One definition serves both: pretraining asks for every optimizer step, the linear probe for
every epoch (``steps_per_epoch = 1``). The momentum schedule of the key encoder is
:func:`pipeline.moco.momentum.momentum_schedule`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeline.config import LrSchedule
from pipeline.errors import InputError

LR_REFERENCE_BATCH = 256  # ``lr`` params are per 256 images (linear scaling, Goyal et al. 2017)


def lr_schedule(*, base_lr: float, batch_size: int, total_steps: int, steps_per_epoch: int,
                schedule: str, warmup_epochs: float = 0.0,
                milestones: Sequence[int] = ()) -> list[float]:
    """The learning rate of every optimizer step.

    Args:
        base_lr: lr per 256 images; the effective lr is ``base_lr * batch_size / 256``
            (linear scaling, Goyal et al. 2017, as in MoCo).
        batch_size: global batch size (images per optimizer step).
        total_steps: optimizer steps of the whole run.
        steps_per_epoch: optimizer steps per epoch.
        schedule: ``cosine`` (half-cosine to 0 over the steps after warm-up, MoCo v2) or
            ``step`` (x0.1 at each milestone epoch, MoCo v1 and its linear protocol: milestones
            [60, 80] of 100 epochs give epochs 61-80 at 0.1x and 81-100 at 0.01x; milestones
            past the end never fire).
        warmup_epochs: linear warm-up from 0 over this many epochs.
        milestones: epochs at which the step schedule multiplies the lr by 0.1.

    Returns:
        ``total_steps`` learning rates.

    Raises:
        ValueError: an unknown schedule or a non-positive size or lr.
    """
    kind = LrSchedule.parse(schedule, "lr_schedule")
    for name, v in (("base_lr", base_lr), ("batch_size", batch_size),
                    ("total_steps", total_steps), ("steps_per_epoch", steps_per_epoch)):
        if not (v > 0 and math.isfinite(v)):
            raise InputError(f"lr_schedule: '{name}' = {v!r} is invalid; allowed: > 0")
    peak = base_lr * batch_size / LR_REFERENCE_BATCH
    warm = int(round(warmup_epochs * steps_per_epoch))
    out = []
    for s in range(total_steps):
        if s < warm:
            lr = peak * (s + 1) / warm
        elif kind == LrSchedule.cosine:
            lr = peak * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total_steps - warm)))
        else:
            epoch = s / steps_per_epoch
            lr = peak * 0.1 ** sum(epoch >= m for m in milestones)
        out.append(lr)
    assert len(out) == total_steps
    return out
