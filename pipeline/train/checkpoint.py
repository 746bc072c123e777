"""Resume state: what a checkpoint holds, when one is written, and whether one may be resumed.

A checkpoint (``last.pt``) is written atomically and resumed only when its fingerprint equals
the current run's (:attr:`pipeline.train.training_input.TrainingInput.fingerprint`: the hash of
everything the training reads: the params that decide the weights, the image spec, the
pretraining set's manifest content and the training code). Anything else is ignored with a log
line naming what changed. A checkpoint holds finite values only: a state with a NaN or an
infinity in any parameter or buffer is never written (:class:`NonFiniteError`), and one found
on disk is never resumed. Loading uses ``torch.load(weights_only=True)``: nothing in a
checkpoint can execute code.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.atomic import save_torch
from pipeline.config import flatten
from pipeline.errors import NonFiniteError

if TYPE_CHECKING:
    from pipeline.train.training_input import TrainingInput

log = logging.getLogger(__name__)

def nonfinite(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors of a ``state_dict`` holding a NaN or an infinity."""
    return [k for k, t in state.items()
            if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


def read_header(path: Path) -> dict[str, Any] | None:
    """A checkpoint's dict, memory-mapped (no weights read), or None when there is none.

    None: no file, an unreadable or truncated one, or not a checkpoint. Executes no code
    (``weights_only``). The one reader of a checkpoint's bookkeeping (fingerprint, step, run).
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - an unreadable file is no checkpoint
        log.debug("no checkpoint header in %s: %s", path, e)
        return None
    return ckpt if isinstance(ckpt, dict) else None


def resumable_run_id(path: Path, key: TrainingInput) -> str | None:
    """The MLflow run id stored in a checkpoint that will be resumed, else None.

    The stage asks this BEFORE it starts its MLflow run, so that a resumed training continues
    the interrupted run (one training = one run across resumes).

    Args:
        path: the ``last.pt`` the engine will be given.
        key: this run's training input (its fingerprint is the resume key).

    Returns:
        The run id, or None: no checkpoint, an unreadable one, another fingerprint (it will be
        ignored and training starts fresh), or one written with MLflow disabled.
    """
    ckpt = read_header(path)
    if ckpt is None or ckpt.get("fingerprint") != key.fingerprint:
        return None
    run_id = ckpt.get("mlflow_run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def changed_params(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every dotted key that differs (added/removed shown as ``-``).

    Text longer than 16 characters (a sha256) is shown by its first 12.
    """
    def shown(v: Any) -> str:
        return v[:12] + "..." if isinstance(v, str) and len(v) > 16 else str(v)

    a, b = flatten(old), flatten(new)
    return [f"{k}: {shown(a.get(k, '-'))} -> {shown(b.get(k, '-'))}"
            for k in sorted(set(a) | set(b)) if a.get(k, "-") != b.get(k, "-")]


def load_checkpoint(path: Path, expected_fingerprint: str,
                    described: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Load a checkpoint if it exists, is readable, matches and holds finite values only.

    Loading uses ``torch.load(weights_only=True)``: nothing in a checkpoint can execute code.
    When the fingerprint differs, the log line names what changed (from the training input the
    checkpoint stores: ``params.*``, ``image.*``, ``data.*``, ``code``).

    Args:
        path: the checkpoint file.
        expected_fingerprint: :attr:`TrainingInput.fingerprint` of the current run.
        described: :meth:`TrainingInput.described` of the current run (to explain a mismatch).

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
        old = ckpt.get("training_input") if isinstance(ckpt, dict) else None
        if isinstance(old, dict) and described is not None:
            why = "changed: " + ", ".join(changed_params(old, described) or ["the fingerprint"])
        else:
            why = "it was made from another training input (params, data or code)"
        log.warning("ignoring checkpoint %s (%s; fingerprint %s, now %s): starting fresh",
                    path, why, str(found)[:12], expected_fingerprint[:12])
        return None
    bad = nonfinite(ckpt["model"])
    if bad:  # written before checkpoints were checked: resuming it would fail again
        log.warning("ignoring checkpoint %s (non-finite values in %s%s): starting fresh", path,
                    bad[0], f" and {len(bad) - 1} more tensors" if len(bad) > 1 else "")
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
        labelfree_rows: label-free monitor rows so far (``plots/labelfree.tsv``).
        wall_before_s: training wall time of earlier (interrupted) processes, seconds.
        num_threads: CPU intra-op threads in use; a resumed run keeps them (float reductions
            depend on the thread count, so this keeps resume bit-identical).
        monitor: the monitor params the monitor rows were made with (:data:`MONITOR_PARAMS`);
            rows made with others are not continued (:meth:`Checkpointer.restore`).
    """

    step: int = 0
    rows: list[dict[str, float]] = field(default_factory=list)
    knn_rows: list[dict[str, float]] = field(default_factory=list)
    labelfree_rows: list[dict[str, float]] = field(default_factory=list)
    wall_before_s: float = 0.0
    num_threads: int = 0
    monitor: dict[str, int] = field(default_factory=dict)


# The params that define the monitor's rows: they decide no weight (they are not in the
# fingerprint), but rows made under others measure something else
MONITOR_PARAMS = ("knn_every_epochs", "knn_monitor_train_images", "knn_monitor_test_images",
                  "labelfree_images")


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
        key: the run's training input; a checkpoint with another fingerprint
            is ignored.
        is_main: only rank 0 writes.
        run_id: the MLflow run of this training, stored so that a resume continues that run
            (:func:`resumable_run_id`).
        monitor: this run's monitor params (:data:`MONITOR_PARAMS`). A checkpoint whose rows
            were made with others gives its kNN and label-free rows up, with a warning (the
            verdict needs the rows from the random init on, under one definition).
    """

    def __init__(self, path: Path, key: TrainingInput, is_main: bool,
                 run_id: str | None = None, monitor: dict[str, int] | None = None) -> None:
        self.path, self.key, self.run_id = Path(path), key, run_id
        self.monitor = dict(monitor or {})
        self.is_main = is_main
        self.t_start = time.time()

    def restore(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler) -> TrainState:
        """Load a matching checkpoint into the objects; a fresh state when there is none."""
        ckpt = load_checkpoint(self.path, self.key.fingerprint, self.key.described())
        if ckpt is None:
            return TrainState(monitor=dict(self.monitor))
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        torch.set_rng_state(ckpt["rng_cpu"])
        if ckpt.get("rng_cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ckpt["rng_cuda"])
        made_with, monitor = dict(ckpt.get("monitor") or {}), self.monitor
        same = made_with == monitor
        if not same and self.is_main:
            changed = [f"pretrain.{k}: {made_with.get(k, '-')} -> {v}" for k, v in monitor.items()
                       if made_with.get(k) != v]
            log.warning("pretrain: the checkpoint's monitor rows were made with other monitor "
                        "params (%s): they are dropped, so this run gets no verdict (to get "
                        "one: `python -m pipeline clean-checkpoints`, then retrain)",
                        ", ".join(changed))
        return TrainState(step=int(ckpt["step"]), rows=list(ckpt["rows"]),
                          knn_rows=list(ckpt["knn_rows"]) if same else [],
                          labelfree_rows=list(ckpt.get("labelfree_rows", [])) if same else [],
                          wall_before_s=float(ckpt["wall_time_s"]),
                          num_threads=int(ckpt.get("num_threads", 0)), monitor=dict(monitor))

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
        ckpt = read_header(self.path)
        if ckpt is None or ckpt.get("fingerprint") != self.key.fingerprint:
            return None
        try:
            return int(ckpt["step"])
        except (KeyError, TypeError, ValueError):
            return None

    def kept(self) -> str:
        """Which checkpoint a rerun resumes from, for a failure's message."""
        saved = self.saved_step()
        return (f"the last good checkpoint is kept at {self.path} (step {saved})"
                if saved is not None else "no checkpoint was written yet")

    def save(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler, state: TrainState) -> None:
        """Write ``last.pt`` atomically (rank 0 only), if every parameter and buffer is finite.

        Raises:
            NonFiniteError: a parameter or buffer of ``net`` (a BatchNorm running variance,
                say) holds a NaN or an infinity; nothing is written, the checkpoint on disk
                stays.
        """
        model = net.state_dict()
        bad = nonfinite(model)
        if bad:
            more = f" and {len(bad) - 1} more tensors" if len(bad) > 1 else ""
            raise NonFiniteError(
                f"non-finite values in {bad[0]}{more} at step {state.step}: not saved; "
                f"training stopped, {self.kept()}. Lower pretrain.lr or check the data")
        if not self.is_main:
            return
        save_torch({
            "fingerprint": self.key.fingerprint, "training_input": self.key.described(),
            "step": state.step, "model": model, "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "rows": state.rows, "knn_rows": state.knn_rows,
            "labelfree_rows": state.labelfree_rows,
            "wall_time_s": self.wall_time(state), "num_threads": state.num_threads,
            "monitor": state.monitor, "mlflow_run_id": self.run_id,
        }, self.path)
