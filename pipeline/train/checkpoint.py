"""Resume state: what a checkpoint holds, when one is written, and whether one may be resumed.

A checkpoint (``last.pt``) is written atomically and resumed only when its fingerprint equals
the current one: the hash of the params that affect training, the pretraining shards' sha256
(from the manifest) and the source of the modules that define the training math. Anything else
is ignored with a log line naming what changed. Loading uses ``torch.load(weights_only=True)``:
nothing in a checkpoint can execute code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import save_torch
from pipeline.config import (
    AugmentParams,
    MocoParams,
    ModelParams,
    PretrainParams,
    flatten,
    to_dict,
)

log = logging.getLogger(__name__)

# Library modules whose source is part of the fingerprint (changing them restarts training).
TRAINING_CODE = ("train/engine.py", "train/plan.py", "train/runtime.py", "schedules.py",
                 "train/checkpoint.py", "moco/queue.py", "moco/momentum.py", "moco/loss.py",
                 "moco/batchnorm.py", "moco/backbones.py", "moco/model.py", "moco/distributed.py",
                 "data/views.py", "data/loader.py", "seeds.py")
# pretrain.* keys that change how fast or how visibly training runs, never its result
NOT_FINGERPRINTED = ("checkpoint_every_epochs", "checkpoint_every_steps", "knn_every_epochs",
                     "knn_monitor_train_images", "knn_monitor_test_images", "log_every_steps",
                     "compile", "num_threads")


def training_params(seed: int, model: ModelParams, moco: MocoParams, augment: AugmentParams,
                    opt: PretrainParams, world_size: int) -> dict[str, Any]:
    """The params that decide the trained weights (the fingerprint's input), as plain values."""
    return {"seed": seed, "model": to_dict(model), "moco": to_dict(moco),
            "augment": to_dict(augment), "world_size": world_size,
            "pretrain": {k: v for k, v in to_dict(opt).items() if k not in NOT_FINGERPRINTED}}


def checkpoint_fingerprint(seed: int, model: ModelParams, moco: MocoParams,
                           augment: AugmentParams, opt: PretrainParams, world_size: int,
                           manifest: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(fingerprint, training params) that a checkpoint must carry to be resumed.

    The one computation of the engine and of :func:`pipeline.train.resume.resumable_run_id`.

    Args:
        seed: ``seed``.
        model: ``model`` section.
        moco: ``moco`` section.
        augment: ``augment`` section.
        opt: ``pretrain`` section.
        world_size: number of training processes.
        manifest: the pretraining split's manifest (its shards' sha256 enter the hash).
    """
    params = training_params(seed, model, moco, augment, opt, world_size)
    return fingerprint(params, [s["sha256"] for s in manifest["shards"]]), params


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
    pkg = Path(__file__).resolve().parents[1]
    for rel in TRAINING_CODE:
        f = pkg / rel
        h.update(rel.encode())
        h.update(f.read_bytes() if f.is_file() else b"<missing>")
    return h.hexdigest()


def changed_params(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every dotted param that differs (added/removed shown as ``-``)."""
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


@dataclass
class TrainState:
    """Everything besides the model and optimizer that a resumed run needs to continue exactly.

    Attributes:
        step: optimizer steps done (global).
        rows: logged rows so far (``plots/pretrain.tsv``).
        knn_rows: kNN-monitor rows so far (``plots/knn_monitor.tsv``).
        wall_before_s: training wall time of earlier (interrupted) processes, seconds.
        num_threads: CPU intra-op threads in use; a resumed run keeps them (float reductions
            depend on the thread count, so this keeps resume bit-identical).
    """

    step: int = 0
    rows: list[dict[str, float]] = field(default_factory=list)
    knn_rows: list[dict[str, float]] = field(default_factory=list)
    wall_before_s: float = 0.0
    num_threads: int = 0


@dataclass
class CheckpointPolicy:
    """When to write ``last.pt``: every N epochs, every N steps (0 = off), and at the end.

    SIGTERM/SIGINT force a checkpoint through :meth:`Checkpointer.save` regardless.
    """

    every_epochs: int
    every_steps: int
    total_steps: int
    steps_per_epoch: int

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after ``step`` steps."""
        epoch_end = step % self.steps_per_epoch == 0
        return ((epoch_end and (step // self.steps_per_epoch) % self.every_epochs == 0)
                or (self.every_steps > 0 and step % self.every_steps == 0)
                or step == self.total_steps)


class Checkpointer:
    """Saves and restores model, optimizer, scaler, RNG states and :class:`TrainState`.

    Args:
        path: the checkpoint file (``<checkpoint_dir>/last.pt``), written atomically.
        fingerprint: hash of everything that determines training
            (:func:`fingerprint`); a checkpoint with another one is ignored.
        train_params: the params behind the fingerprint, stored so that an ignored checkpoint's
            log line can name what changed.
        is_main: only rank 0 writes.
        run_id: the MLflow run of this training, stored so that a resume continues that run
            (:func:`pipeline.train.resume.resumable_run_id`).
    """

    def __init__(self, path: Path, fingerprint: str, train_params: dict[str, Any],
                 is_main: bool, run_id: str | None = None) -> None:
        self.path, self.fingerprint, self.run_id = path, fingerprint, run_id
        self.train_params, self.is_main = train_params, is_main
        self.t_start = time.time()

    def restore(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler) -> TrainState:
        """Load a matching checkpoint into the objects; a fresh state when there is none."""
        ckpt = load_checkpoint(self.path, self.fingerprint, self.train_params)
        if ckpt is None:
            return TrainState()
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        torch.set_rng_state(ckpt["rng_cpu"])
        if ckpt.get("rng_cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ckpt["rng_cuda"])
        return TrainState(step=int(ckpt["step"]), rows=list(ckpt["rows"]),
                          knn_rows=list(ckpt["knn_rows"]),
                          wall_before_s=float(ckpt["wall_time_s"]),
                          num_threads=int(ckpt.get("num_threads", 0)))

    def wall_time(self, state: TrainState) -> float:
        """Training wall time so far, seconds, including interrupted processes."""
        return state.wall_before_s + time.time() - self.t_start

    def saved_step(self) -> int | None:
        """The step of this run's ``last.pt`` on disk, or None.

        None when there is no file, it is unreadable, or it belongs to other training (another
        fingerprint: a rerun would ignore it).

        Read from the file rather than remembered: a signal handler (PyTorch's SIGCHLD handler
        for a dead loader worker) can raise between the atomic rename of a new checkpoint and
        any bookkeeping after it, so only the file says which one stands.
        """
        if not self.path.is_file():
            return None
        try:
            ckpt = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            return int(ckpt["step"]) if ckpt.get("fingerprint") == self.fingerprint else None
        except Exception:  # noqa: BLE001 - an unreadable file is no checkpoint to resume from
            return None

    def save(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler, state: TrainState) -> None:
        """Write ``last.pt`` atomically (rank 0 only)."""
        if not self.is_main:
            return
        save_torch({
            "fingerprint": self.fingerprint, "train_params": self.train_params,
            "step": state.step, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "rows": state.rows, "knn_rows": state.knn_rows,
            "wall_time_s": self.wall_time(state), "num_threads": state.num_threads,
            "mlflow_run_id": self.run_id,
        }, self.path)
