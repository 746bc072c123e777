"""Which MLflow run a resumed pretraining continues: one training = one run, across resumes.

The engine stores the MLflow run id in ``last.pt``
(:class:`~pipeline.train.checkpoint.Checkpointer`).
The stage must know it BEFORE it starts its MLflow run, so that ``mlflow.start_run(run_id=...)``
reopens the interrupted run instead of creating a new one; the engine decides later, from the
same fingerprint, that it resumes the same checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.config import AugmentParams, MocoParams, ModelParams, PretrainParams
from pipeline.train.checkpoint import checkpoint_fingerprint

log = logging.getLogger(__name__)


def resumable_run_id(checkpoint: Path | Callable[[str], Path], *, seed: int,
                     model: ModelParams, moco: MocoParams, augment: AugmentParams,
                     opt: PretrainParams,
                     pretrain_set: dict[str, Any], world_size: int) -> str | None:
    """The MLflow run id stored in a checkpoint that the engine will resume, else None.

    The checkpoint is resumed when its fingerprint equals this run's (the same computation as
    the engine's: :func:`pipeline.train.checkpoint.checkpoint_fingerprint`). Reading it loads no
    weights into memory (``mmap``) and executes no code (``weights_only``).

    Args:
        checkpoint: the ``last.pt`` to look at, or a function of the run's fingerprint giving
            it (the resume store's entry, :mod:`pipeline.train.resume_store`).
        seed: ``seed``.
        model: ``model`` section.
        moco: ``moco`` section.
        augment: ``augment`` section.
        opt: ``pretrain`` section.
        pretrain_set: the pretraining set's manifest (:func:`pipeline.data.index.pretrain_manifest`;
            its shards' sha256 enter the fingerprint).
        world_size: number of training processes (``WORLD_SIZE``, 1 without torchrun).

    Returns:
        The run id, or None: no checkpoint, an unreadable one, another fingerprint (it will be
        ignored and training starts fresh), or one written with MLflow disabled.
    """
    fp, _ = checkpoint_fingerprint(seed, model, moco, augment, opt, world_size, pretrain_set)
    checkpoint = Path(checkpoint(fp) if callable(checkpoint) else checkpoint)
    if not checkpoint.is_file():
        return None
    try:
        ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - the engine reports an unreadable checkpoint itself
        log.debug("no resumable run in %s: %s", checkpoint, e)
        return None
    if not isinstance(ckpt, dict) or ckpt.get("fingerprint") != fp:
        return None
    run_id = ckpt.get("mlflow_run_id")
    return run_id if isinstance(run_id, str) and run_id else None
