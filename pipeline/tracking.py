"""MLflow tracking shared by every stage: one executed DVC stage = one MLflow run.

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
* Stale runs: at stage start, runs of the same stage and repo left RUNNING by a process that no
  longer exists (SIGKILL, the OOM killer) are marked KILLED with an end time and a
  ``stale.reason`` tag.
* Each run is tagged with the stage, git commit, dirty flag, DVC experiment name and baseline
  rev, the run ids of the upstream stages (read from their ``runs/<stage>.json``), the repo root
  and the process that owns it.
* Params are flattened with dots (the names DVC uses) and the resolved config is logged as an
  artifact. SIGTERM/SIGINT end the run as KILLED (tag ``killed.reason``); any other exception
  as FAILED (``failed.reason``); a run is
  FINISHED only if the process then exits 0 (see :mod:`pipeline.signals`).
* A pretraining resumed from its checkpoint continues the interrupted run (same run id, status
  RUNNING again, then FINISHED; tags ``interrupted.count`` and ``interrupted.<n>`` record each
  interruption): one training = one run.
* The MLflow UI's runs table of the experiment opens at :func:`ui_url` (MLflow 3.17 chooses the
  GenAI or the model-training view from the ``workflowType`` URL parameter, not from a tag).
* Only rank 0 logs; ``mlflow.enabled: false`` turns everything into no-ops (``run.json`` is still
  written, with ``run_id: null``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline import signals
from pipeline.atomic import round_metrics, write_json
from pipeline.config import Params, flatten, to_dict
from pipeline.data.remote import ShardURL
from pipeline.signals import Terminated

log = logging.getLogger(__name__)

RUNS_DIR = "runs"
ARTIFACTS_DIR = "mlartifacts"
# MLflow 3's experiment kind tag, recorded for tools that classify experiments. It does NOT pick
# the UI's view (MLflow 3.17: the `workflowType` URL parameter does, default GenAI): see ui_url.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
_SECRET_WORDS = ("password", "secret", "token", "key_id", "access_key", "credential")


class TrackingError(RuntimeError):
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


def git_state(cwd: Path | None = None) -> dict[str, str]:
    """Commit hash and dirty flag of the working tree (``unknown`` outside git).

    Dirty means a tracked file differs from the commit: code, params, docs, anything but what
    the pipeline writes itself (:func:`pipeline_outputs`: the stages' ``outs``, ``metrics`` and
    ``plots`` and ``dvc.lock``). Without that exception every run of a clean clone would be
    dirty, its git-tracked metrics and plots being rewritten by the run. Untracked files do
    not count.
    """

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              timeout=30, cwd=cwd).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        top = Path(git("rev-parse", "--show-toplevel").strip())
        status = git("status", "--porcelain=v1", "-z", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {"git.commit": "unknown", "git.dirty": "unknown"}
    outputs = pipeline_outputs(str(Path(cwd or Path.cwd()).resolve()), str(top.resolve()))
    dirty = any(not any(p == o or p.startswith(o + "/") for o in outputs)
                for p in _changed_paths(status))
    return {"git.commit": commit, "git.dirty": str(dirty).lower()}


def _changed_paths(porcelain_z: str) -> list[str]:
    """Paths of ``git status --porcelain=v1 -z`` (both sides of a rename or copy)."""
    fields, paths, i = porcelain_z.split("\0"), [], 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if len(entry) < 4:
            continue
        paths.append(entry[3:])
        if entry[0] in "RC":  # "R  new\0old": the old path is the next field
            paths.append(fields[i])
            i += 1
    return paths


@functools.lru_cache(maxsize=8)
def pipeline_outputs(cwd: str, git_top: str) -> tuple[str, ...]:
    """What the DVC pipeline writes, as paths relative to ``git_top`` (``/``-separated).

    Read with DVC's own API (the way ``dvc repro`` reads them, ``${...}`` interpolated from
    ``params.yaml``): every stage's ``outs``, ``metrics`` and ``plots`` in every ``dvc.yaml``
    of the DVC repo around ``cwd``, and the ``dvc.lock`` beside each ``dvc.yaml``.

    Args:
        cwd: a directory inside the DVC repo (absolute).
        git_top: the git work tree's top level (absolute).

    Returns:
        The paths, sorted; empty outside a DVC repo, or when DVC cannot read the pipeline (one
        warning line: :func:`git_state` then counts every changed file).
    """
    from dvc.exceptions import DvcException, NotDvcRepoError
    from dvc.repo import Repo

    found: set[str] = set()
    try:
        with Repo(cwd) as repo:
            for stage in repo.index.stages:
                found.update(out.fs_path for out in stage.outs)
                path = getattr(stage.dvcfile, "path", "")
                if Path(path).name == "dvc.yaml":
                    found.add(str(Path(path).with_name("dvc.lock")))
    except NotDvcRepoError:
        return ()
    except (DvcException, OSError) as e:
        log.warning("git.dirty counts every changed file: DVC cannot list the pipeline's "
                    "outputs (%s)", error_summary(e))
        return ()
    top = Path(git_top)
    return tuple(sorted(Path(os.path.abspath(p)).relative_to(top).as_posix() for p in found
                        if Path(os.path.abspath(p)).is_relative_to(top)))


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


def read_run_record(stage: str, root: Path | None = None) -> dict[str, Any]:
    """What a stage recorded in ``runs/<stage>.json`` (run id, experiment, model ids).

    Returns:
        The record; ``{}`` when the file is absent or unreadable.
    """
    path = (root or Path.cwd()) / RUNS_DIR / f"{stage}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def read_run_id(stage: str, root: Path | None = None) -> str | None:
    """The run id recorded by an upstream stage in ``runs/<stage>.json`` (None if absent)."""
    return read_run_record(stage, root).get("run_id")


UI_HOST = "http://127.0.0.1:5000"  # `make ui` / `mlflow ui` on a database


def ui_url(uri: str, experiment_id: str | None) -> str:
    """The MLflow UI page of an experiment's runs table (the model-training view).

    Args:
        uri: the tracking URI: a server's own address, or a database (then the UI is the one
            ``make ui`` starts, :data:`UI_HOST`).
        experiment_id: the experiment; None = the experiments list.

    Returns:
        ``<server>/#/experiments/<id>/runs?workflowType=machine_learning`` (credentials in a
        server URI are left out).
    """
    from urllib.parse import urlsplit, urlunsplit

    base = UI_HOST
    if uri.startswith(("http://", "https://")):
        u = urlsplit(uri)
        host = u.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        base = urlunsplit((u.scheme, netloc + (f":{u.port}" if u.port else ""),
                           u.path.rstrip("/"), "", ""))
    if experiment_id is None:
        return f"{base}/#/experiments"
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def find_experiment_id(uri: str, name: str, root: Path) -> str | None:
    """This repo's experiment id, without creating anything (None: no database or experiment).

    The same choice as :func:`open_experiment`: ``name`` when its artifacts live in this repo
    (or with a server), else ``<name> (<root>)``.
    """
    db = _local_db(uri)
    if db is not None and not db.is_file():
        return None
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    wanted = str((root / ARTIFACTS_DIR).resolve()) if db is not None else None
    for candidate in (name, f"{name} ({root})"):
        exp = client.get_experiment_by_name(candidate)
        if exp is not None and exp.lifecycle_stage != "deleted" and (
                wanted is None or _uri_path(exp.artifact_location) == wanted):
            return exp.experiment_id
    return None


def experiment_ui_url(uri: str | None = None, params_path: str | Path = "params.yaml") -> str:
    """:func:`ui_url` of this repo's experiment (``make ui`` prints it before starting).

    Args:
        uri: the tracking URI (default :func:`tracking_uri`).
        params_path: where ``mlflow.experiment`` is read (the default name when unreadable).
    """
    from pipeline.config import ParamsError, load_params

    uri = uri or tracking_uri()
    try:
        name = load_params(params_path).mlflow.experiment
    except ParamsError:
        name = Params().mlflow.experiment
    return ui_url(uri, find_experiment_id(uri, name, repo_root()))


class StageRun:
    """Handle for logging inside :func:`stage_run`; every method is a no-op when disabled."""

    def __init__(self, run: Any | None, *, resumed: bool = False) -> None:
        self._run = run
        self.run_id: str | None = run.info.run_id if run is not None else None
        self.experiment_id: str | None = run.info.experiment_id if run is not None else None
        self.resumed = resumed  # an interrupted run continued (see stage_run's resume_run_id)
        # more fields for runs/<stage>.json (e.g. the logged model's id), written at the end
        self.record: dict[str, Any] = {}

    @property
    def active(self) -> bool:
        """Whether anything is logged."""
        return self._run is not None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, *,
                    model_id: str | None = None, dataset: Any | None = None) -> None:
        """Log numeric metrics (non-numeric values are skipped).

        Args:
            metrics: name -> value (rounded as in the metrics files).
            step: the step (None = 0).
            model_id: also link them to this MLflow logged model (its Models-view columns);
                the run then lists the model among its inputs.
            dataset: the ``mlflow.data`` dataset they were measured on (from
                :meth:`log_shards`).
        """
        if self._run is None:
            return
        import mlflow

        clean = {k: float(v) for k, v in round_metrics(metrics).items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if clean:
            mlflow.log_metrics(clean, step=step, model_id=model_id, dataset=dataset)

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

    def log_shards(self, split_dir: str | Path | ShardURL, context: str) -> Any | None:
        """Record a shard split as an MLflow dataset input (digest = sha256 of its manifest).

        Args:
            split_dir: a shard directory holding ``manifest.json``, or its URL (logged with an
                HTTP dataset source for ``http(s)``, the URL as the source otherwise).
            context: ``training`` or ``evaluation``.

        Returns:
            The logged ``mlflow.data`` dataset (for :meth:`log_metrics`), None when disabled or
            the manifest is unreadable.
        """
        if self._run is None:
            return None
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
                return None  # the stage itself reports the unreadable manifest
            source: Any = (HTTPDatasetSource(str(where)) if where.scheme in ("http", "https")
                           else LocalArtifactDatasetSource(str(where)))
        else:
            from mlflow.data.sources import LocalArtifactDatasetSource

            manifest = where / "manifest.json"
            if not manifest.is_file():
                return None
            raw = manifest.read_bytes()
            source = LocalArtifactDatasetSource(str(where.resolve()))
        m = json.loads(raw)
        digest = hashlib.sha256(raw).hexdigest()[:36]  # MLflow caps at 36
        ds = MetaDataset(source=source, digest=digest,
                         name=f"{m.get('source', 'data')}/{m.get('split', where.name)}")
        mlflow.log_input(ds, context=context)
        return ds

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set run tags."""
        if self._run is not None:
            import mlflow

            mlflow.set_tags(tags)


def _local_db(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for a server or another store)."""
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def _uri_path(uri: str | None) -> str | None:
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
def _init_lock(uri: str, timeout_s: float = 300.0) -> Iterator[None]:
    """An exclusive file lock beside a SQLite database (no lock for a server)."""
    db = _local_db(uri)
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

    local = _local_db(uri) is not None
    wanted = str((root / ARTIFACTS_DIR).resolve()) if local else None
    try:
        with _init_lock(uri):
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
                if wanted is None or _uri_path(exp.artifact_location) == wanted:
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
    path = _uri_path(exp.artifact_location) if exp is not None else None
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


def _proc_start(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (Linux), None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 (starttime), after "pid (comm)"


def process_tags() -> dict[str, str]:
    """Who owns a run: host, boot id, pid and start time (to tell later whether it is alive)."""
    import socket

    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown"
    return {"proc.host": socket.gethostname(), "proc.boot_id": boot,
            "proc.pid": str(os.getpid()), "proc.start": _proc_start(os.getpid()) or "unknown"}


def _owner_dead(tags: dict[str, str], me: dict[str, str]) -> bool:
    """Whether the process that owns a run is known to be gone (same host and boot only)."""
    if tags.get("proc.host") != me["proc.host"] or "proc.pid" not in tags:
        return False  # another machine, or a run without owner tags: cannot tell
    if tags.get("proc.boot_id") != me["proc.boot_id"]:
        return me["proc.boot_id"] != "unknown"  # the machine rebooted since
    start = _proc_start(int(tags["proc.pid"]))
    if start is None:
        return Path("/proc").is_dir()  # without /proc we cannot tell
    return start != tags.get("proc.start")  # the pid was reused by another process


def mark_stale_runs(uri: str, experiment_id: str, stage: str, root: Path) -> list[str]:
    """Mark KILLED the runs of ``stage`` in this repo left RUNNING by a dead process.

    A SIGKILL (e.g. the OOM killer) gives a process no chance to end its run. The run's end
    time becomes now, and tag ``stale.reason`` says why.

    Returns:
        The ids of the runs marked KILLED.
    """
    import time

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    me = process_tags()
    marked = []
    runs = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'",
                              max_results=1000)
    for r in runs:
        tags = r.data.tags
        if tags.get("stage") != stage or tags.get("repo.root") != str(root):
            continue
        if not _owner_dead(tags, me):
            continue
        client.set_tag(r.info.run_id, "stale.reason",
                       f"process {tags['proc.pid']} on {tags['proc.host']} ended without closing "
                       "this run (SIGKILL, OOM killer or power loss); marked KILLED when the "
                       f"stage started again (pid {me['proc.pid']})")
        client.set_terminated(r.info.run_id, "KILLED", end_time=int(time.time() * 1000))
        log.warning("MLflow run %s of stage %s was left RUNNING by a dead process: marked KILLED",
                    r.info.run_id, stage)
        marked.append(r.info.run_id)
    return marked


@contextlib.contextmanager
def stage_run(stage: str, params: Params, *, upstream: tuple[str, ...] = (), rank: int = 0,
              extra_tags: dict[str, str] | None = None, system_metrics: bool = False,
              resume_run_id: str | None = None) -> Iterator[StageRun]:
    """One MLflow run for one executed stage, written to ``runs/<stage>.json`` at the end.

    The run ends FINISHED only when the block completes; from that moment a stage entry point
    holds signals (:func:`pipeline.signals.hold`), and a signal held until the process's last
    check turns the run KILLED again, so a FINISHED run always means exit 0.

    With ``resume_run_id`` (the run stored in a checkpoint the stage resumes), that run is
    continued when it is this stage's, in this experiment, and ended KILLED or FAILED (also one
    the stale-run sweep just marked KILLED): same run id, status RUNNING again, metric steps
    continuing. Its ``killed.reason``/``stale.reason``/``failed.reason`` tag becomes
    ``interrupted.<n>`` (``interrupted.count`` = n), so a FINISHED run carries no kill reason.
    Params not logged yet are added; a param whose value changed since (only those that do not
    decide the weights can) keeps its first value, and tag ``resume.changed_params`` names it.
    Any other run id (FINISHED, unknown, another stage) starts a new run.

    Args:
        stage: DVC stage name (``pretrain``, ``knn``, ...).
        params: the validated params (flattened into MLflow params).
        upstream: names of the stages whose run ids are recorded as ``upstream.<stage>`` tags.
        rank: process rank; only rank 0 talks to MLflow.
        extra_tags: more tags.
        system_metrics: also sample CPU/GPU/memory usage (MLflow system metrics: psutil, and
            nvidia-ml-py for GPUs).
        resume_run_id: the run to continue (:func:`pipeline.train.checkpoint.resumable_run_id`).

    Yields:
        A :class:`StageRun` (its ``record`` fields join ``runs/<stage>.json``).

    Raises:
        TrackingError: the tracking backend is unreachable (raised before any work).
        Terminated: SIGTERM or SIGINT (the run is marked KILLED first).
    """
    enabled = params.mlflow.enabled and rank == 0
    root = Path.cwd()
    if not enabled:
        with signals.handled():
            yield StageRun(None)
        if rank == 0:
            write_json(root / RUNS_DIR / f"{stage}.json", {"stage": stage, "run_id": None})
        return

    with signals.handled():
        import mlflow

        uri = tracking_uri()
        check_reachable(uri)
        repo = repo_root()
        exp_id = open_experiment(uri, params.mlflow.experiment, repo)
        mark_stale_runs(uri, exp_id, stage, repo)
        mlflow.set_tracking_uri(uri)
        tags = {"stage": stage, **git_state(root), **dvc_tags(), "repo.root": str(repo),
                **process_tags(), **(extra_tags or {})}
        for up in upstream:
            tags[f"upstream.{up}"] = read_run_id(up, root) or "unknown"
        run_name = f"{os.environ.get('DVC_EXP_NAME', 'workspace')}:{stage}"
        old = _reopenable(uri, resume_run_id, exp_id, stage) if resume_run_id else None
        run = None
        try:
            if old is None:
                run = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=tags,
                                       log_system_metrics=system_metrics)
                mlflow.log_params(loggable_params(params))
            else:
                run = _reopen(uri, old, tags, loggable_params(params), system_metrics)
            mlflow.log_dict(to_dict(params), "config/params.resolved.json")
            handle = StageRun(run, resumed=old is not None)
            yield handle
            write_json(root / RUNS_DIR / f"{stage}.json", {
                **handle.record, "stage": stage, "run_id": run.info.run_id,
                "experiment_id": run.info.experiment_id, "tracking_uri": uri})
        except Terminated as e:
            _end_active("KILLED", {"killed.reason": str(e) or signals.signal_name(e.signum)})
            raise
        except BaseException as e:
            _end_active("FAILED", {"failed.reason": f"{type(e).__name__}: {e}"[:1000]})
            raise
        run_id = run.info.run_id
        signals.hold(lambda signum: _late_kill(uri, run_id, signum))
        mlflow.end_run("FINISHED")


def _reopenable(uri: str, run_id: str, experiment_id: str, stage: str) -> Any | None:
    """The run to continue: this stage's, in this experiment, ended KILLED or FAILED; else None.

    A FINISHED run belongs to a training that ended (a forced rerun is a new run); a RUNNING one
    may still have a live owner (the stale-run sweep has already run).
    """
    from mlflow.tracking import MlflowClient

    try:
        r = MlflowClient(tracking_uri=uri).get_run(run_id)
    except Exception as e:  # noqa: BLE001 - e.g. the checkpoint came from another database
        log.info("checkpoint's MLflow run %s not found (%s): starting a new run", run_id,
                 error_summary(e))
        return None
    if (r.info.experiment_id != experiment_id or r.data.tags.get("stage") != stage
            or r.info.lifecycle_stage != "active" or r.info.status not in ("KILLED", "FAILED")):
        log.info("checkpoint's MLflow run %s is %s (stage %s, experiment %s): starting a new run",
                 run_id, r.info.status, r.data.tags.get("stage"), r.info.experiment_id)
        return None
    return r


def _reopen(uri: str, old: Any, tags: dict[str, str], params: dict[str, str],
            system_metrics: bool) -> Any:
    """Continue run ``old`` (status RUNNING again): interruption tags, the params it lacks."""
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    before, run_id = old.data.tags, old.info.run_id
    n = int(before.get("interrupted.count", "0")) + 1
    why = (before.get("killed.reason") or before.get("stale.reason")
           or before.get("failed.reason") or "no reason recorded")
    tags = {**tags, "interrupted.count": str(n),
            f"interrupted.{n}": f"{old.info.status}: {why}; resumed from the checkpoint by pid "
                                f"{tags['proc.pid']} on {tags['proc.host']}"}
    for stale in ("killed.reason", "stale.reason", "failed.reason"):
        if stale in before:
            client.delete_tag(run_id, stale)
    logged = old.data.params
    changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
    if changed:
        tags["resume.changed_params"] = ", ".join(
            f"{k}: {logged[k]} -> {params[k]}" for k in changed)[:5000]
    run = mlflow.start_run(run_id=run_id, tags=tags, log_system_metrics=system_metrics)
    new = {k: v for k, v in params.items() if k not in logged}
    if new:
        mlflow.log_params(new)
    log.info("MLflow run %s continues (interruption %d: %s)", run_id, n, old.info.status)
    return run


def _end_active(status: str, tags: dict[str, str]) -> None:
    """End the active MLflow run (if any) with ``status``; never raises."""
    import mlflow

    try:
        if mlflow.active_run() is not None:
            if tags:
                mlflow.set_tags(tags)
            mlflow.end_run(status)
    except Exception as e:  # noqa: BLE001 - the original error matters more
        log.warning("could not mark the MLflow run %s: %s", status, error_summary(e))


def _late_kill(uri: str, run_id: str, signum: int) -> None:
    """A signal arrived after the run was FINISHED and before the process exited: KILLED."""
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=uri)
        client.set_tag(run_id, "killed.reason", f"{signals.signal_name(signum)} as the stage "
                       "ended (after its work): the stage exits non-zero, so the run is not "
                       "FINISHED")
        client.set_terminated(run_id, "KILLED")
    except Exception as e:  # noqa: BLE001 - report and still exit non-zero
        log.warning("could not mark MLflow run %s KILLED: %s", run_id, error_summary(e))
