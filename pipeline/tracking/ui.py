"""The MLflow UI page of this repo's experiment (what ``make ui`` prints).

MLflow 3.17 chooses the GenAI or the model-training view from the ``workflowType`` URL
parameter, not from a tag: :func:`ui_url` asks for the model-training runs table.

Its runs table shows no metric column by default (its default columns are Source, Models and
Dataset, and no setting changes them). What it does read is a *saved view*: an experiment tag
``mlflow.sharedViewState.<id>`` whose value holds the view's name and its state (the columns,
the filter), opened by the URL parameter ``viewStateShareKey=<id>`` and listed by name in the
page's views menu. Every stage writes :data:`HEADLINE_VIEW` into its experiment
(:func:`ensure_headline_view`): the report runs (one row per pipeline run, every headline
number in it) with the headline columns (:mod:`pipeline.tracking.headline`); :func:`ui_url`
opens it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from pipeline.config import Params
from pipeline.tracking.headline import headline_names
from pipeline.tracking.store import ARTIFACTS_DIR, local_db, repo_root, tracking_uri, uri_path

log = logging.getLogger(__name__)


UI_HOST = "http://127.0.0.1:5000"  # `make ui` / `mlflow ui` on a database


VIEW_TAG_PREFIX = "mlflow.sharedViewState."  # MLflow 3.17's saved views (experiment tags)


HEADLINE_VIEW = "headline"  # the saved view's id: tag mlflow.sharedViewState.headline


HEADLINE_VIEW_NAME = "Headline top-1 (one row per pipeline run)"


# The runs table's first columns in MLflow 3.17 (run name, created, duration; the checkbox
# column's id is generated, and it is pinned first anyway), by their grid ids;
# tests/test_mlflow_server.py reads them back from the rendered page.
TABLE_LEADING_COLUMNS = ("attributes.`Run Name`", "runDateAndNestInfo", "duration")


def headline_view_state() -> dict[str, Any]:
    """The state of :data:`HEADLINE_VIEW`: the report runs, the headline metrics as columns.

    The keys are those MLflow 3.17's experiment page restores from a saved view (its search
    facets and UI state); the ones left out keep their defaults there.
    """
    columns = [f"metrics.`{name}`" for name in headline_names()]
    return {"searchFilter": "tags.stage = 'report'", "selectedColumns": columns,
            # the page applies columnWidths only to the columns columnOrder lists, and puts
            # those first: the table's own leading columns (MLflow 3.17's ids) come first here
            "columnOrder": [*TABLE_LEADING_COLUMNS, *columns],
            # wide enough for the whole name (a header is cut at its column's width)
            "columnWidths": {c: 24 + 7 * len(name) for c, name in zip(columns, headline_names())}}


def ensure_headline_view(client: Any, experiment_id: str) -> None:
    """Write :data:`HEADLINE_VIEW` into the experiment's tags unless it holds this state.

    The tag's value is MLflow's saved-view envelope: ``{"name", "createdAt" (ms), "state"}``
    with ``state`` the JSON of :func:`headline_view_state`.

    Args:
        client: an ``MlflowClient``.
        experiment_id: the experiment.
    """
    key, state = VIEW_TAG_PREFIX + HEADLINE_VIEW, json.dumps(headline_view_state())
    try:
        old = json.loads(client.get_experiment(experiment_id).tags.get(key, "{}"))
    except ValueError:
        old = {}
    if old.get("state") == state and old.get("name") == HEADLINE_VIEW_NAME:
        return
    client.set_experiment_tag(experiment_id, key, json.dumps(
        {"name": HEADLINE_VIEW_NAME, "createdAt": int(time.time() * 1000), "state": state}))


def ui_url(uri: str, experiment_id: str | None, view: str | None = HEADLINE_VIEW) -> str:
    """The MLflow UI page of an experiment's runs table (the model-training view).

    Args:
        uri: the tracking URI: a server's own address, or a database (then the UI is the one
            ``make ui`` starts, :data:`UI_HOST`).
        experiment_id: the experiment; None = the experiments list.
        view: the saved view to open (:data:`HEADLINE_VIEW`: the headline columns); None = the
            table as MLflow shows it.

    Returns:
        ``<server>/#/experiments/<id>/runs?workflowType=machine_learning&viewStateShareKey=
        headline`` (credentials in a server URI are left out).
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
    url = f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    return url + (f"&viewStateShareKey={view}" if view else "")


def runs_table_hint(experiment_id: str | None, uri: str | None = None) -> str | None:
    """Where to see the runs: ``make ui, then <url>`` for a database, a server's URL as it is.

    Args:
        experiment_id: the experiment (None: MLflow is off; no hint).
        uri: the tracking URI (default :func:`tracking_uri`).
    """
    if experiment_id is None:
        return None
    uri = uri or tracking_uri()
    url = ui_url(uri, experiment_id)
    return url if uri.startswith(("http://", "https://")) else f"`make ui`, then {url}"


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

    It opens :data:`HEADLINE_VIEW` when the experiment holds it (every stage writes it; an
    experiment last written by older code does not, and MLflow would answer the URL with an
    error), else the plain runs table.

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
    experiment_id = find_experiment_id(uri, name, repo_root())
    if experiment_id is None:
        return ui_url(uri, None)
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(tracking_uri=uri).get_experiment(experiment_id).tags
    return ui_url(uri, experiment_id,
                  HEADLINE_VIEW if VIEW_TAG_PREFIX + HEADLINE_VIEW in tags else None)
