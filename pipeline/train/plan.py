"""Before the first step: the run's sizes and schedules checked against the data, and the model.

Epochs are true epochs (:func:`pipeline.data.loader.train_loader`): ``steps_per_epoch`` full
global batches (default ``pretrain images // batch_size``), identical on every rank, so DDP can
never hang. The lr and momentum schedules are precomputed per optimizer step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import (
    BnMode,
    MocoParams,
    ModelParams,
    ParamsError,
    PretrainParams,
)
from pipeline.data.checks import check_queue_size
from pipeline.data.manifest import Manifest
from pipeline.data.remote import ShardURL
from pipeline.data.shards import ImageSpec, image_spec
from pipeline.errors import InputError
from pipeline.moco.backbones import (
    build_backbone,
    build_head,
    resolve_small_stem,
    resolve_stem_stride,
)
from pipeline.moco.batchnorm import check_bn_mode
from pipeline.moco.model import MoCo
from pipeline.moco.momentum import momentum_schedule
from pipeline.schedules import lr_schedule

log = logging.getLogger(__name__)


class PlanError(InputError):
    """The run's sizes do not fit the data or the processes (the message names the param)."""


@dataclass(frozen=True)
class RunPlan:
    """Sizes and schedules of a run, fixed before any training.

    Attributes:
        spec: channels, training image side (px), normalisation, and whether the images vary
            in size (then the crop runs per image in the loader workers).
        per_rank_batch: images per step on one rank.
        steps_per_epoch: optimizer steps per epoch.
        total_steps: optimizer steps of the run.
        lrs: the learning rate of every step (``total_steps`` values).
        momenta: the key-encoder momentum of every step (``total_steps`` values).
    """

    spec: ImageSpec
    per_rank_batch: int
    steps_per_epoch: int
    total_steps: int
    lrs: list[float]
    momenta: list[float]


def plan_run(manifest: Manifest, where: Path | ShardURL | str, *, opt: PretrainParams,
             moco: MocoParams, world_size: int, cuda: bool) -> RunPlan:
    """Check the run's sizes against the pretraining data and precompute the schedules.

    Args:
        manifest: the ``pretrain`` split's manifest.
        where: its directory or URL, or the parts it joins (for messages).
        opt: the ``pretrain`` params.
        moco: the ``moco`` params (K, BN mode).
        world_size: number of processes.
        cuda: whether training runs on CUDA (SyncBN needs it).

    Raises:
        PlanError: batch not divisible by the ranks, an epoch longer than the data, a queue
            at least as long as the data (``moco.K >= N``, moco#146), a BN mode that does not
            fit, or SyncBN on CPU (each message names the param).
        ShardError: the manifest's images have no single training size.
    """
    spec = image_spec(manifest, where)
    n_images = manifest.num_samples
    if opt.batch_size % world_size:
        raise PlanError(f"pretrain.batch_size ({opt.batch_size}) must be divisible by the "
                        f"number of processes ({world_size})")
    full = n_images // opt.batch_size
    spe = opt.steps_per_epoch or full
    if full < 1:
        raise PlanError(f"pretrain.batch_size ({opt.batch_size}) exceeds the {n_images} "
                        "pretraining images: lower it or add images")
    if spe > full:
        raise PlanError(f"pretrain.steps_per_epoch ({spe}) exceeds one epoch of the {n_images} "
                        f"pretraining images at batch {opt.batch_size} ({full} steps)")
    try:
        check_bn_mode(moco.bn, opt.batch_size // world_size, moco.bn_splits, world_size)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if moco.bn == BnMode.sync and not cuda:
        raise PlanError("moco.bn = 'sync' needs CUDA (torch's SyncBatchNorm rejects CPU tensors "
                        "in training); use 'shuffle' under torchrun on CPU")
    try:
        check_queue_size(moco.K, n_images, str(where))
    except ParamsError as e:
        raise PlanError(str(e)) from None
    if 2 * moco.K >= n_images:
        log.warning("moco.K = %d is at least half the pretraining set (%d images): every image "
                    "has a key in the queue after half an epoch, older keys of the same images "
                    "follow (moco#146)", moco.K, n_images)
    total = spe * opt.epochs
    lrs = lr_schedule(base_lr=opt.lr, batch_size=opt.batch_size, total_steps=total,
                      steps_per_epoch=spe, schedule=opt.lr_schedule,
                      warmup_epochs=opt.warmup_epochs, milestones=opt.lr_milestones)
    momenta = momentum_schedule(moco.m, total, moco.m_schedule)
    assert len(lrs) == len(momenta) == total
    return RunPlan(spec, opt.batch_size // world_size, spe, total, lrs, momenta)


def build_moco(model: ModelParams, moco: MocoParams, *, in_channels: int, image_size: int,
               world_size: int = 1) -> MoCo:
    """Build the MoCo module (query + key encoders, queue) for the given params.

    Raises:
        ValueError: an invalid backbone name or BN mode for ``world_size``.
    """
    small = resolve_small_stem(model.small_stem, image_size)
    backbone = build_backbone(model.backbone, width=model.width, in_channels=in_channels,
                              small_stem=small,
                              stem_stride=resolve_stem_stride(model.stem_stride, small))
    head = build_head(model.head, backbone.num_features, model.head_hidden, model.dim)
    return MoCo(backbone, head, K=moco.K, m=moco.m, T=moco.T, symmetric=moco.symmetric,
                bn=moco.bn, bn_splits=moco.bn_splits, world_size=world_size)
