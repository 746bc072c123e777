"""Where runs go: the tracking URI, the database and the experiment, and tracking errors.

* Tracking URI: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<repo root>/mlflow.db`` where
  the repo root is ``DVC_ROOT`` (set by DVC, also for ``dvc exp run --temp/--queue``) or the git
  top level, so every way of running the pipeline logs to one database.
* Artifacts: with a database (no tracking server) they go to ``<repo root>/mlartifacts``. An
  experiment's artifact location is fixed when it is created, so when the configured experiment
  stores its artifacts elsewhere (the database was copied or moved with the repo, or was made
  by older code) this repo logs to its own experiment ``<name> (<repo root>)``: artifacts never
  land outside the repo that produced them. With a tracking server, the server's artifact store
  (e.g. ``--artifacts-destination``) is the configured store.
* The database and the experiment are created once, under a file lock (``<db>.lock``), before
  the first run: parallel queued experiments can start from no database.
* A failure is one line (:func:`error_summary`), never SQLAlchemy's statement.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError

log = logging.getLogger(__name__)


ARTIFACTS_DIR = "mlartifacts"


# MLflow 3's experiment kind tag, recorded for tools that classify experiments. It does NOT pick
# the UI's view (MLflow 3.17: the `workflowType` URL parameter does, default GenAI): see ui_url.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"


EXPERIMENT_KIND = "custom_model_development"


class TrackingError(PipelineError, RuntimeError):
    """The tracking server or database cannot be used."""


ERROR_SUMMARY_CHARS = 300


def error_summary(e: BaseException, limit: int = ERROR_SUMMARY_CHARS) -> str:
    """``<Type>: <what failed>`` on one line, never a raw SQL statement.

    SQLAlchemy's errors, and MLflow's exceptions wrapping them, carry the statement, its
    parameters and a help link on later lines (``[SQL: INSERT INTO ...]``: one warning about a
    failed tag was 1,087 characters of it). The database driver's own error (``.orig`` of the
    SQLAlchemy error in the exception chain, e.g. ``IntegrityError: FOREIGN KEY constraint
    failed``) says what failed; for any other exception, the first line of its message.

    Args:
        e: the exception.
        limit: at most this many characters (cut with ``...``).

    Returns:
        E.g. ``MlflowException: IntegrityError: FOREIGN KEY constraint failed``.
    """
    orig, cur, seen = None, e, set()
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(getattr(cur, "orig", None), BaseException):
            orig = cur.orig
            break
        cur = cur.__cause__ or cur.__context__
    what = _first_line(orig if orig is not None else e)
    text = f"{type(e).__name__}: " + (f"{type(orig).__name__}: {what}" if orig is not None
                                       else what)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message that is not SQLAlchemy's autoflush note."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("(raised as a result of")] or lines
    return lines[0] if lines else "(no message)"


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


def local_db(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for a server or another store)."""
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def uri_path(uri: str | None) -> str | None:
    """The local path of a ``file:`` URI or plain path (None for a remote location)."""
    if not uri:
        return None
    from urllib.parse import unquote, urlparse

    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return os.path.normpath(unquote(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return os.path.normpath(os.path.abspath(uri))
    return None


@contextlib.contextmanager
def init_lock(uri: str, timeout_s: float = 300.0) -> Iterator[None]:
    """An exclusive file lock beside a SQLite database (no lock for a server)."""
    db = local_db(uri)
    if db is None:
        yield
        return
    from filelock import FileLock, Timeout

    lock = FileLock(str(db) + ".lock")
    try:
        with lock.acquire(timeout=timeout_s):
            yield
    except Timeout:
        raise TrackingError(f"waited {timeout_s:.0f} s for the MLflow database lock "
                            f"{lock.lock_file}; is another stage stuck?") from None


def open_experiment(uri: str, name: str, root: Path) -> str:
    """Create (once, under a file lock) or find this repo's experiment; return its id.

    With a database, the experiment's artifact location must be ``<root>/mlartifacts``; an
    experiment of that name storing artifacts elsewhere belongs to another checkout (a copied
    database, or older code), so this repo uses ``<name> (<root>)`` instead. With a tracking
    server the server decides where artifacts go.

    Args:
        uri: tracking URI.
        name: the configured experiment name (``mlflow.experiment``).
        root: the repo root (see :func:`repo_root`).

    Returns:
        The experiment id.

    Raises:
        TrackingError: the database, lock or experiment cannot be used (e.g. it was deleted).
    """
    from mlflow.tracking import MlflowClient

    local = local_db(uri) is not None
    wanted = str((root / ARTIFACTS_DIR).resolve()) if local else None
    try:
        with init_lock(uri):
            client = MlflowClient(tracking_uri=uri)  # the first use creates the tables
            for candidate in (name, f"{name} ({root})"):
                exp = client.get_experiment_by_name(candidate)
                if exp is None:
                    exp_id = client.create_experiment(
                        candidate, artifact_location=Path(wanted).as_uri() if wanted else None,
                        tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, "repo.root": str(root)})
                    if candidate != name:
                        log.warning("MLflow experiment '%s' stores its artifacts outside this "
                                    "repo; logging to experiment '%s' (artifacts in %s)%s", name,
                                    candidate, wanted, _moved_hint(client, name))
                    return exp_id
                if exp.lifecycle_stage == "deleted":
                    raise TrackingError(f"MLflow experiment '{candidate}' is deleted; restore "
                                        "it (mlflow experiments restore) or set mlflow.experiment")
                if wanted is None or uri_path(exp.artifact_location) == wanted:
                    if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
                        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG,
                                                  EXPERIMENT_KIND)
                    return exp.experiment_id
            raise TrackingError(f"MLflow experiment '{name} ({root})' stores its artifacts in "
                                f"{exp.artifact_location}, not in {wanted}")
    except TrackingError:
        raise
    except Exception as e:  # noqa: BLE001 - any backend failure is fatal at start
        raise (_newer_schema_error(uri, e)
               or TrackingError(f"cannot use MLflow experiment '{name}' at {uri}: "
                               f"{error_summary(e)}")) from e


def _moved_hint(client: Any, name: str) -> str:
    """A hint when experiment ``name``'s artifact folder is gone (the repo was moved), else ''."""
    exp = client.get_experiment_by_name(name)
    path = uri_path(exp.artifact_location) if exp is not None else None
    if path is None or Path(path).exists():
        return ""
    return (f"; {path} is gone: if this repo was moved from there, `python -m pipeline "
            "relocate-mlflow` repoints the database (docs/tracking.md)")


def _newer_schema_error(uri: str, e: Exception) -> TrackingError | None:
    """The database's schema is NEWER than this MLflow's: name both revisions and what helps.

    MLflow answers any schema mismatch with "run `mlflow db upgrade`", which cannot take a
    database back to an older schema. Returns None for any other error (an OLDER schema
    included: there the upgrade advice is right).
    """
    import re

    m = re.search(r"found version (\w+), but expected (\w+)", str(e))
    if not m:
        return None
    found, newest = m.groups()
    try:
        from alembic.script import ScriptDirectory
        from mlflow.store.db.utils import _get_alembic_config

        ScriptDirectory.from_config(_get_alembic_config(db_url="")).get_revision(found)
        return None  # a revision this MLflow knows: older, `mlflow db upgrade` fits
    except ImportError:
        return None
    except Exception:  # noqa: BLE001 - alembic's "Can't locate revision": unknown = newer
        pass
    import mlflow

    return TrackingError(
        f"MLflow database {uri} has schema revision {found}, which this MLflow "
        f"({mlflow.__version__}, newest revision {newest}) does not know: a newer MLflow "
        "created or upgraded it, and `mlflow db upgrade` cannot go back. Upgrade mlflow and "
        "mlflow-skinny here to that newer version, or point MLFLOW_TRACKING_URI at another "
        "database")
