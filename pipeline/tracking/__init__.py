"""MLflow tracking, one concern per module; every executed DVC stage is one MLflow run.

* :mod:`~pipeline.tracking.store`: where runs go (tracking URI, database, experiment, errors).
* :mod:`~pipeline.tracking.runs`: one run per executed stage (:func:`stage_run`), stale runs,
  resumed runs, ``runs/<stage>.json``.
* :mod:`~pipeline.tracking.provenance`: git state, DVC's experiment, the owning process, params.
* :mod:`~pipeline.tracking.datasets`: shard splits as MLflow dataset inputs.
* :mod:`~pipeline.tracking.ui`: the MLflow UI page of this repo's experiment, its saved view of
  the headline numbers.
* :mod:`~pipeline.tracking.headline`: the numbers compared between runs (``top1.*``), and the
  lines ``dvc repro`` ends with.
* :mod:`~pipeline.tracking.curves`: curves as run artifacts (a table and a figure).
* :mod:`~pipeline.tracking.model`: the encoder as an MLflow logged model.
* :mod:`~pipeline.tracking.registry`: its registry versions, trust by md5, scores, champion.
* :mod:`~pipeline.tracking.relocate`: repointing a moved repo's database.

No module here changes an output's bytes (``pipeline.codegraph.NOT_OUTPUT_CODE``): a tracking
edit reruns no stage. The names below are the ones stages and users import most.
"""

from pipeline.tracking.provenance import git_state, loggable_params
from pipeline.tracking.relocate import resolve_model_uri
from pipeline.tracking.runs import StageRun, read_run_id, read_run_record, stage_run
from pipeline.tracking.store import (
    TrackingError,
    error_summary,
    open_experiment,
    repo_root,
    tracking_uri,
)
from pipeline.tracking.ui import experiment_ui_url, find_experiment_id, ui_url

__all__ = ["StageRun", "TrackingError", "error_summary", "experiment_ui_url",
           "find_experiment_id", "git_state", "loggable_params", "open_experiment",
           "read_run_id", "read_run_record", "repo_root", "resolve_model_uri", "stage_run",
           "tracking_uri", "ui_url"]
