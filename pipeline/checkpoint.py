"""Atomic checkpoints with a fingerprint of everything that determines training.

A checkpoint is resumed only when its fingerprint equals the current one: the hash of the
params that affect training, the pretraining shards' sha256 (from the manifest) and the source
of the modules that define the training math. Anything else is ignored with a log line.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import save_torch as save_atomic  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

# Library modules whose source is part of the fingerprint (changing them restarts training).
TRAINING_CODE = ("train/engine.py", "train/runtime.py", "train/state.py", "checkpoint.py",
                 "moco/queue.py", "moco/momentum.py", "moco/loss.py", "moco/batchnorm.py",
                 "moco/backbones.py", "moco/model.py", "moco/distributed.py", "data/augment.py",
                 "data/batch_augment.py", "data/loader.py")


def fingerprint(training_params: dict[str, Any], shard_hashes: list[str]) -> str:
    """sha256 over the training params (canonical JSON), shard hashes and training code.

    Args:
        training_params: nested dict of the params that change the trained weights.
        shard_hashes: sha256 of every pretraining shard, in manifest order.

    Returns:
        A 64-character hex digest.
    """
    h = hashlib.sha256()
    h.update(json.dumps(training_params, sort_keys=True, default=str).encode())
    for s in shard_hashes:
        h.update(s.encode())
    pkg = Path(__file__).resolve().parent
    for rel in TRAINING_CODE:
        f = pkg / rel
        h.update(rel.encode())
        h.update(f.read_bytes() if f.is_file() else b"<missing>")
    return h.hexdigest()


def changed_params(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every dotted param that differs (added/removed shown as ``-``)."""
    from pipeline.config import flatten

    a, b = flatten(old), flatten(new)
    return [f"{k}: {a.get(k, '-')} -> {b.get(k, '-')}" for k in sorted(set(a) | set(b))
            if a.get(k, "-") != b.get(k, "-")]


def load_checkpoint(path: Path, expected_fingerprint: str,
                    training_params: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Load a checkpoint if it exists, is readable and matches ``expected_fingerprint``.

    Loading uses ``torch.load(weights_only=True)``: nothing in a checkpoint can execute code.
    When the fingerprint differs, the log line names the params that changed (from the
    ``train_params`` the checkpoint stores), or says that the shards or training code changed.

    Args:
        path: the checkpoint file.
        expected_fingerprint: :func:`fingerprint` of the current run.
        training_params: the current run's training params (to explain a mismatch).

    Returns:
        The checkpoint dict, or None (with a log line saying why) to start fresh.
    """
    path = Path(path)
    if not path.is_file():
        log.info("no checkpoint at %s: starting fresh", path)
        return None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file means: start fresh
        log.warning("ignoring unreadable checkpoint %s (%s): starting fresh", path, e)
        return None
    found = ckpt.get("fingerprint") if isinstance(ckpt, dict) else None
    if found != expected_fingerprint:
        old = ckpt.get("train_params") if isinstance(ckpt, dict) else None
        if isinstance(old, dict) and training_params is not None:
            diff = changed_params(old, training_params)
            why = ("changed params: " + ", ".join(diff)) if diff else (
                "same params, so the shards or the training code changed")
        else:
            why = "it was made with different params, shards or training code"
        log.warning("ignoring checkpoint %s (%s; fingerprint %s, now %s): starting fresh",
                    path, why, str(found)[:12], expected_fingerprint[:12])
        return None
    log.info("resuming from %s at step %d", path, ckpt["step"])
    return ckpt
