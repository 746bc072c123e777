"""Training state: what a checkpoint holds, when one is written, and resuming from one."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint import load_checkpoint, save_atomic

log = logging.getLogger(__name__)


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
            (:func:`pipeline.checkpoint.fingerprint`); a checkpoint with another one is ignored.
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

    def save(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler, state: TrainState) -> None:
        """Write ``last.pt`` atomically (rank 0 only)."""
        if not self.is_main:
            return
        save_atomic({
            "fingerprint": self.fingerprint, "train_params": self.train_params,
            "step": state.step, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "rows": state.rows, "knn_rows": state.knn_rows,
            "wall_time_s": self.wall_time(state), "num_threads": state.num_threads,
            "mlflow_run_id": self.run_id,
        }, self.path)
