"""MLflow tracking shared by every stage: one executed DVC stage = one MLflow run.

* Tracking URI: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<repo root>/mlflow.db`` where
  the repo root is ``DVC_ROOT`` (set by DVC, also for ``dvc exp run --temp/--queue``) or the git
  top level, so every way of running the pipeline logs to one database.
* Each run is tagged with the stage, git commit, dirty flag, DVC experiment name and baseline
  rev, and the run ids of the upstream stages (read from their ``runs/<stage>.json``).
* Params are flattened with dots (the names DVC uses) and the resolved config is logged as an
  artifact. SIGTERM ends the run as KILLED; any other exception as FAILED; never RUNNING.
* Only rank 0 logs; ``mlflow.enabled: false`` turns everything into no-ops (``run.json`` is still
  written, with ``run_id: null``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.atomic import write_json
from pipeline.config import Params, flatten, to_dict
from pipeline.data.remote import ShardURL

log = logging.getLogger(__name__)

RUNS_DIR = "runs"
_SECRET_WORDS = ("password", "secret", "token", "key_id", "access_key", "credential")


class Terminated(BaseException):
    """Raised in the main thread when the process receives SIGTERM (or SIGINT during training).

    Args:
        message: what happened (e.g. where the checkpoint was written).
        signum: the signal received (the exit code is ``128 + signum``).
    """

    def __init__(self, message: str = "", signum: int = signal.SIGTERM) -> None:
        super().__init__(message)
        self.signum = int(signum)


class TrackingError(RuntimeError):
    """The tracking server or database cannot be used."""


def repo_root() -> Path:
    """The pipeline's root: ``DVC_ROOT``, else the git top level, else the current directory."""
    env = os.environ.get("DVC_ROOT")
    if env:
        return Path(env)
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True, timeout=10)
        return Path(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return Path.cwd()


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<repo root>/mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def git_state(cwd: Path | None = None) -> dict[str, str]:
    """Commit hash and dirty flag of the working tree (``unknown`` outside git)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              timeout=30, cwd=cwd).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"git.commit": "unknown", "git.dirty": "unknown"}
    return {"git.commit": commit, "git.dirty": str(dirty).lower()}


def dvc_tags() -> dict[str, str]:
    """DVC's environment (experiment name, baseline rev, stage) as tags."""
    names = {"DVC_EXP_NAME": "dvc.exp_name", "DVC_EXP_BASELINE_REV": "dvc.baseline_rev",
             "DVC_STAGE": "dvc.stage"}
    return {tag: os.environ[env] for env, tag in names.items() if os.environ.get(env)}


def loggable_params(params: Params) -> dict[str, str]:
    """Flattened params (dotted DVC names) as strings, with nothing secret-looking.

    Raises:
        ValueError: a param name looks like a secret (it would be logged in clear).
    """
    flat = flatten(to_dict(params))
    for k in flat:
        if any(w in k.lower() for w in _SECRET_WORDS):
            raise ValueError(f"refusing to log param '{k}': looks like a secret")
    return {k: str(v) for k, v in flat.items()}


def check_reachable(uri: str, timeout_s: float = 10.0) -> None:
    """Fail fast when the tracking backend cannot be used.

    For ``http(s)://`` URIs the server's ``/health`` endpoint must answer; for ``sqlite:///``
    the database's directory must exist and be writable.

    Raises:
        TrackingError: the backend is unreachable, with the URI in the message.
    """
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as r:
                if r.status != 200:
                    raise TrackingError(f"MLflow server {uri} answered HTTP {r.status}")
        except (urllib.error.URLError, OSError) as e:
            raise TrackingError(f"MLflow tracking server {uri} is unreachable: {e}. Start it, "
                                "unset MLFLOW_TRACKING_URI, or set mlflow.enabled: false") from None
    elif uri.startswith("sqlite:///"):
        parent = Path(uri[len("sqlite:///"):]).parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise TrackingError(f"MLflow database directory {parent} is missing or not writable")


def read_run_id(stage: str, root: Path | None = None) -> str | None:
    """The run id recorded by an upstream stage in ``runs/<stage>.json`` (None if absent)."""
    path = (root or Path.cwd()) / RUNS_DIR / f"{stage}.json"
    try:
        return json.loads(path.read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON atomically (kept here for the stage scripts; see :mod:`pipeline.atomic`)."""
    write_json(path, obj)


@contextlib.contextmanager
def sigterm_as_exception() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` inside the block (main thread only)."""

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(f"received signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class StageRun:
    """Handle for logging inside :func:`stage_run`; every method is a no-op when disabled."""

    def __init__(self, run: Any | None) -> None:
        self._run = run
        self.run_id: str | None = run.info.run_id if run is not None else None

    @property
    def active(self) -> bool:
        """Whether anything is logged."""
        return self._run is not None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log numeric metrics (non-numeric values are skipped)."""
        if self._run is None:
            return
        import mlflow

        clean = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if clean:
            mlflow.log_metrics(clean, step=step)

    def log_params(self, params: dict[str, Any]) -> None:
        """Log extra params (strings)."""
        if self._run is not None:
            import mlflow

            mlflow.log_params({k: str(v) for k, v in params.items()})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Log a file or directory as an artifact when it exists."""
        if self._run is None or not Path(path).exists():
            return
        import mlflow

        if Path(path).is_dir():
            mlflow.log_artifacts(str(path), artifact_path=artifact_path)
        else:
            mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def log_shards(self, split_dir: str | Path | ShardURL, context: str) -> None:
        """Record a shard split as an MLflow dataset input (digest = sha256 of its manifest).

        Args:
            split_dir: a shard directory holding ``manifest.json``, or its URL (logged with an
                HTTP dataset source for ``http(s)``, the URL as the source otherwise).
            context: ``training`` or ``evaluation``.
        """
        if self._run is None:
            return
        import hashlib

        import mlflow
        from mlflow.data.meta_dataset import MetaDataset

        from pipeline.data.remote import RemoteError, read_url, shards_location

        where = shards_location(split_dir)
        if isinstance(where, ShardURL):
            from mlflow.data.http_dataset_source import HTTPDatasetSource
            from mlflow.data.sources import LocalArtifactDatasetSource

            try:
                raw = read_url(where / "manifest.json")
            except RemoteError:
                return  # the stage itself reports the unreadable manifest
            source: Any = (HTTPDatasetSource(str(where)) if where.scheme in ("http", "https")
                           else LocalArtifactDatasetSource(str(where)))
        else:
            from mlflow.data.sources import LocalArtifactDatasetSource

            manifest = where / "manifest.json"
            if not manifest.is_file():
                return
            raw = manifest.read_bytes()
            source = LocalArtifactDatasetSource(str(where.resolve()))
        m = json.loads(raw)
        digest = hashlib.sha256(raw).hexdigest()[:36]  # MLflow caps at 36
        ds = MetaDataset(source=source, digest=digest,
                         name=f"{m.get('source', 'data')}/{m.get('split', where.name)}")
        mlflow.log_input(ds, context=context)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set run tags."""
        if self._run is not None:
            import mlflow

            mlflow.set_tags(tags)


@contextlib.contextmanager
def stage_run(stage: str, params: Params, *, upstream: tuple[str, ...] = (), rank: int = 0,
              extra_tags: dict[str, str] | None = None,
              system_metrics: bool = False) -> Iterator[StageRun]:
    """One MLflow run for one executed stage, written to ``runs/<stage>.json`` at the end.

    Args:
        stage: DVC stage name (``pretrain``, ``knn``, ...).
        params: the validated params (flattened into MLflow params).
        upstream: names of the stages whose run ids are recorded as ``upstream.<stage>`` tags.
        rank: process rank; only rank 0 talks to MLflow.
        extra_tags: more tags.
        system_metrics: also sample CPU/GPU/memory usage (MLflow system metrics, psutil).

    Yields:
        A :class:`StageRun`.

    Raises:
        TrackingError: the tracking backend is unreachable (raised before any work).
    """
    enabled = params.mlflow.enabled and rank == 0
    root = Path.cwd()
    if not enabled:
        with sigterm_as_exception():
            yield StageRun(None)
        if rank == 0:
            write_json_atomic(root / RUNS_DIR / f"{stage}.json", {"stage": stage, "run_id": None})
        return

    import mlflow

    uri = tracking_uri()
    check_reachable(uri)
    mlflow.set_tracking_uri(uri)
    try:
        mlflow.set_experiment(params.mlflow.experiment)
    except Exception as e:  # noqa: BLE001 - any backend failure is fatal at start
        raise TrackingError(f"cannot use MLflow experiment '{params.mlflow.experiment}' at "
                            f"{uri}: {e}") from e
    tags = {"stage": stage, **git_state(root), **dvc_tags(), **(extra_tags or {})}
    for up in upstream:
        tags[f"upstream.{up}"] = read_run_id(up, root) or "unknown"
    run_name = f"{os.environ.get('DVC_EXP_NAME', 'workspace')}:{stage}"
    with sigterm_as_exception(), mlflow.start_run(run_name=run_name, tags=tags,
                                                  log_system_metrics=system_metrics) as run:
        handle = StageRun(run)
        try:
            mlflow.log_params(loggable_params(params))
            mlflow.log_dict(to_dict(params), "config/params.resolved.json")
            yield handle
        except (Terminated, KeyboardInterrupt):
            mlflow.end_run("KILLED")
            raise
    write_json_atomic(root / RUNS_DIR / f"{stage}.json", {
        "stage": stage, "run_id": run.info.run_id, "experiment_id": run.info.experiment_id,
        "tracking_uri": uri})
