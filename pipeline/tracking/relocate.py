"""Repoint an MLflow database at a moved repo: ``python -m pipeline relocate-mlflow``.

Logging straight to a database (no tracking server), MLflow stores every artifact location as
an absolute path, fixed when the experiment is created (mlflow#3144). After ``mv repo repo2``
the artifacts are in ``repo2/mlartifacts`` but the database still names ``repo/mlartifacts``:
every registered version fails to load (``No such artifact: ''``) and the stages log to a new
experiment ``<name> (<repo2>)``. :func:`relocate` rewrites the old root to the new one wherever
the database names it as a location: the experiments' artifact locations, the runs' artifact
URIs, the logged models' artifact locations, the model versions' storage locations and sources,
and the ``repo.root`` tags of experiments and runs (:mod:`pipeline.tracking.runs` sets them). The
datasets' sources (where the shards were read) stay as recorded: they are history.

The rewrite goes through SQLAlchemy with MLflow's own table definitions, in one transaction.

Before it runs, :func:`resolve_model_uri` still finds a moved repo's models: a ``models:/`` URI
whose recorded artifacts lie under a root that is gone, while the same ``mlartifacts/...`` path
exists beside the database (or in this repo), resolves to that folder, which
``mlflow.pytorch.load_model`` and ``mlflow.models.get_model_info`` load as they are; a model
found nowhere is one line naming ``python -m pipeline relocate-mlflow``. It writes nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from pipeline.tracking.store import (
    ARTIFACTS_DIR,
    TrackingError,
    local_db,
    repo_root,
    tracking_uri,
    uri_path,
)

log = logging.getLogger(__name__)

ROOT_TAG = "repo.root"


def _locations() -> list[tuple[Any, str]]:
    """(MLflow's table, column) of every artifact location a database stores."""
    from mlflow.store.model_registry.dbmodels.models import SqlModelVersion
    from mlflow.store.tracking.dbmodels.models import SqlExperiment, SqlLoggedModel, SqlRun

    return [(SqlExperiment.__table__, "artifact_location"), (SqlRun.__table__, "artifact_uri"),
            (SqlLoggedModel.__table__, "artifact_location"),
            (SqlModelVersion.__table__, "storage_location"), (SqlModelVersion.__table__, "source")]


def _moved(value: str | None, old: Path, new: Path) -> str | None:
    """``value`` with ``old`` (as a ``file:`` URI or a plain path) replaced by ``new``.

    None when ``value`` does not lie under ``old``.
    """
    if not value:
        return None
    for before, after in ((old.as_uri(), new.as_uri()), (str(old), str(new))):
        if value == before or value.startswith(before + "/"):
            return after + value[len(before):]
    return None


def _engine(uri: str) -> Any:
    """A SQLAlchemy engine on the database of ``uri``, after MLflow checked its schema.

    Raises:
        TrackingError: ``uri`` is a tracking server or no database file exists.
    """
    import sqlalchemy
    from mlflow.store.db.db_types import DATABASE_ENGINES
    from mlflow.tracking import MlflowClient

    if uri.split(":", 1)[0].split("+", 1)[0] not in DATABASE_ENGINES:
        raise TrackingError(f"{uri} is not a database: a tracking server keeps artifact "
                            "locations of its own (its --artifacts-destination); nothing to "
                            "relocate here")
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise TrackingError(f"no MLflow database at {uri[len('sqlite:///'):]}")
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # the schema is current
    return sqlalchemy.create_engine(uri)


def moved_roots(uri: str, new: Path) -> list[Path]:
    """The repo roots the database's experiments were created in that no longer exist.

    An experiment of this pipeline keeps its artifacts in ``<root>/mlartifacts``; a root other
    than ``new`` that is gone was moved (to ``new``, presumably: a copy leaves it in place, and
    is relocated only when named, ``--from``).

    Raises:
        TrackingError: as :func:`_engine`.
    """
    import sqlalchemy
    from mlflow.store.tracking.dbmodels.models import SqlExperiment

    table = SqlExperiment.__table__
    with _engine(uri).connect() as con:
        locations = con.execute(sqlalchemy.select(table.c.artifact_location)).scalars().all()
    roots = set()
    for location in locations:
        path = uri_path(location)
        if path and Path(path).name == ARTIFACTS_DIR:
            roots.add(Path(path).parent)
    return sorted(r for r in roots if r != new and not r.exists())


def relocate(uri: str, old: Path, new: Path) -> dict[str, int]:
    """Rewrite root ``old`` to ``new`` in every location and ``repo.root`` tag of a database.

    Args:
        uri: the tracking URI of the database (``sqlite:///...`` or another SQLAlchemy URL).
        old: the repo root the database names (absolute).
        new: the repo root the artifacts are in now (absolute).

    Returns:
        Rows rewritten per ``<table>.<column>``, and ``repo.root tags``.

    Raises:
        TrackingError: ``uri`` is no database (see :func:`_engine`).
    """
    import sqlalchemy
    from mlflow.store.tracking.dbmodels.models import SqlExperimentTag, SqlTag

    counts: dict[str, int] = {}
    with _engine(uri).begin() as con:  # one transaction
        for table, column in _locations():
            keys = list(table.primary_key.columns)
            n = 0
            for row in con.execute(sqlalchemy.select(*keys, table.c[column])).all():
                value = _moved(row[-1], old, new)
                if value is not None:
                    where = sqlalchemy.and_(*(k == v for k, v in zip(keys, row[:-1])))
                    con.execute(sqlalchemy.update(table).where(where).values({column: value}))
                    n += 1
            counts[f"{table.name}.{column}"] = n
        tags = 0
        for tag in (SqlExperimentTag.__table__, SqlTag.__table__):
            tags += con.execute(sqlalchemy.update(tag).where(
                tag.c.key == ROOT_TAG, tag.c.value == str(old)).values(value=str(new))).rowcount
        counts["repo.root tags"] = tags
    return counts


def relocate_main(old: str | None = None, new: str | None = None) -> int:
    """CLI hook: ``python -m pipeline relocate-mlflow [--from OLD] [--to NEW]``.

    Relocates the database of :func:`~pipeline.tracking.tracking_uri` from ``old`` (default:
    every root of :func:`moved_roots`) to ``new`` (default: this repo's root), and prints one
    line saying what changed.

    Returns:
        Exit code: 0 done or nothing to do, 1 an error (printed to stderr).
    """
    import sys

    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    from pipeline.tracking import error_summary

    uri = tracking_uri()
    to = Path(os.path.abspath(new)) if new else repo_root().resolve()
    try:
        roots = [Path(os.path.abspath(old))] if old else moved_roots(uri, to)
        if not roots:
            print(f"nothing to relocate: every repo root that {uri} names exists (a copied "
                  "repo: name the original with --from)")
            return 0
        for root in roots:
            counts = relocate(uri, root, to)
            print(f"relocated {uri} from {root} to {to}: " + ", ".join(
                f"{n} {what}" for what, n in counts.items()))
    except TrackingError as e:
        print(f"error: relocate-mlflow: {e}", file=sys.stderr)
        return 1
    except (MlflowException, SQLAlchemyError, OSError) as e:  # the database: one line
        print(f"error: relocate-mlflow: {error_summary(e)}", file=sys.stderr)
        return 1
    return 0


def _model_location(uri: str, tracking: str) -> str:
    """Where the database says a ``models:/`` URI's artifacts are (MLflow's own resolution).

    ``models:/<name>@<alias>`` and ``models:/<name>/<version>``: the version's download URI;
    ``models:/<model id>``: the logged model's artifact location. A path after the model
    (``models:/<name>/1/MLmodel``) is appended.
    """
    from mlflow import MlflowClient
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository
    from mlflow.store.artifact.utils.models import get_model_name_and_version

    client = MlflowClient(tracking_uri=tracking, registry_uri=tracking)
    base, sub = ModelsArtifactRepository.split_models_uri(uri)
    found = get_model_name_and_version(client, base)
    location = (client.get_logged_model(found[0]).artifact_location if len(found) == 1
                else client.get_model_version_download_uri(*found))
    return f"{location.rstrip('/')}/{sub}" if sub else location


def resolve_model_uri(uri: str, tracking: str | None = None) -> str:
    """A ``models:/`` URI that loads, also from a repo moved since the model was logged.

    Logging straight to a database, MLflow records artifact locations as absolute paths; after
    ``mv repo repo2`` every registered version fails to load (``No such artifact: ''``,
    mlflow#3144) until :func:`relocate` rewrites them. This finds the moved folder instead: when
    the recorded folder is gone, the root above its ``mlartifacts`` is gone too, and the same
    ``mlartifacts/...`` path exists beside the database (or under :func:`repo_root`), that
    folder is returned, with a warning naming ``python -m pipeline relocate-mlflow`` (after it,
    plain MLflow calls load the model too). The database is not changed.

    Args:
        uri: ``models:/<name>@<alias>``, ``models:/<name>/<version>`` or ``models:/<model id>``;
            any other URI is returned as it is.
        tracking: the tracking URI (default :func:`~pipeline.tracking.store.tracking_uri`).

    Returns:
        ``uri`` itself when its artifacts are where the database says (or remote), else the
        absolute path of the moved folder: pass either to ``mlflow.pytorch.load_model``,
        ``mlflow.pyfunc.load_model`` or ``mlflow.models.get_model_info``.

    Raises:
        TrackingError: the recorded folder is gone and no moved copy is found; one line that
            names ``python -m pipeline relocate-mlflow``.
        MlflowException: no such model, version or alias (MLflow's message).
    """
    if not uri.startswith("models:/"):
        return uri
    tracking = tracking or tracking_uri()
    path = uri_path(_model_location(uri, tracking))
    if path is None or Path(path).exists():
        return uri
    parts = Path(path).parts
    at = max((i for i, part in enumerate(parts) if part == ARTIFACTS_DIR), default=None)
    db = local_db(tracking)
    roots = list(dict.fromkeys(r.resolve() for r in ([db.parent] if db else []) + [repo_root()]))
    if at is not None and not Path(*parts[:at]).exists():
        old = Path(*parts[:at])
        for root in roots:
            moved = root.joinpath(*parts[at:])
            if moved.exists():
                log.warning("%s: the MLflow database names %s, which is gone; loading %s (the "
                            "repo was moved: `python -m pipeline relocate-mlflow` repoints the "
                            "database, so that plain MLflow calls load it too)", uri, old, moved)
                return str(moved)
    where = " or ".join(str(r / ARTIFACTS_DIR) for r in roots)
    raise TrackingError(f"{uri}: its artifacts are recorded at {path}, which does not exist, "
                        f"and are not under {where} either: if the repo was moved, run "
                        "`python -m pipeline relocate-mlflow` in it (`--from OLD_ROOT` names "
                        "where it was; docs/tracking.md#a-moved-repo)")
