"""The MLflow UI page of this repo's experiment (what ``make ui`` prints).

MLflow 3.17 chooses the GenAI or the model-training view from the ``workflowType`` URL
parameter, not from a tag: :func:`ui_url` asks for the model-training runs table.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.config import Params
from pipeline.tracking.store import ARTIFACTS_DIR, local_db, repo_root, tracking_uri, uri_path

log = logging.getLogger(__name__)


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
    db = local_db(uri)
    if db is not None and not db.is_file():
        return None
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    wanted = str((root / ARTIFACTS_DIR).resolve()) if db is not None else None
    for candidate in (name, f"{name} ({root})"):
        exp = client.get_experiment_by_name(candidate)
        if exp is not None and exp.lifecycle_stage != "deleted" and (
                wanted is None or uri_path(exp.artifact_location) == wanted):
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
