"""One executed DVC stage = one MLflow run (:func:`stage_run`), and the runs left behind.

* Stale runs: at stage start, runs of the same stage and repo left RUNNING by a process that no
  longer exists (SIGKILL, the OOM killer) are marked KILLED with an end time and a
  ``stale.reason`` tag.
* Each run is tagged with the stage, git commit, dirty flag, DVC experiment name and baseline
  rev, the run ids of the upstream stages (read from their ``runs/<stage>.json``), the repo root
  and the process that owns it (:mod:`pipeline.tracking.provenance`).
* The run is named ``<DVC experiment>:<stage>`` (``workspace:knn`` for ``dvc repro``).
* Params are flattened with dots (the names DVC uses) and the resolved config is logged as an
  artifact. When the stage's block completes, its headline numbers and curves are logged
  (:func:`log_stage_outputs`). SIGTERM/SIGINT end the run as KILLED (tag
  ``killed.reason``); any other exception as FAILED (``failed.reason``); a run is FINISHED only
  if the process then exits 0 (see :mod:`pipeline.signals`).
* A pretraining resumed from its checkpoint continues the interrupted run (same run id, status
  RUNNING again, then FINISHED; tags ``interrupted.count`` and ``interrupted.<n>`` record each
  interruption): one training = one run.
* Only rank 0 logs; ``mlflow.enabled: false`` turns everything into no-ops (``run.json`` is still
  written, with ``run_id: null``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline import signals
from pipeline.atomic import round_metrics, write_json
from pipeline.config import Params, to_dict
from pipeline.data.remote import ShardURL
from pipeline.signals import Terminated
from pipeline.stage_inputs import check_started
from pipeline.tracking.datasets import shard_dataset
from pipeline.tracking.provenance import (
    dvc_tags,
    exp_name,
    git_state,
    loggable_params,
    owner_dead,
    process_tags,
)
from pipeline.tracking.store import (
    check_reachable,
    error_summary,
    open_experiment,
    repo_root,
    tracking_uri,
)
from pipeline.tracking.ui import ensure_headline_view

log = logging.getLogger(__name__)


RUNS_DIR = "runs"


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


class StageRun:
    """Handle for logging inside :func:`stage_run`; every method is a no-op when disabled."""

    def __init__(self, run: Any | None, *, resumed: bool = False) -> None:
        self._run = run
        self.run_id: str | None = run.info.run_id if run is not None else None
        self.experiment_id: str | None = run.info.experiment_id if run is not None else None
        self.resumed = resumed  # an interrupted run continued (see stage_run's resume_run_id)
        # more fields for runs/<stage>.json (e.g. the logged model's id), written at the end
        self.record: dict[str, Any] = {}
        self.logged: set[str] = set()  # the metric names logged so far by this process

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
            self.logged.update(clean)

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
        """Record a shard split as an MLflow dataset input (:func:`shard_dataset`).

        Args:
            split_dir: a shard directory holding ``manifest.json``, or its URL.
            context: ``training`` or ``evaluation``.

        Returns:
            The logged ``mlflow.data`` dataset (for :meth:`log_metrics`), None when disabled or
            the manifest is unreadable.
        """
        if self._run is None:
            return None
        import mlflow

        ds = shard_dataset(split_dir)
        if ds is not None:
            mlflow.log_input(ds, context=context)
        return ds

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set run tags."""
        if self._run is not None:
            import mlflow

            mlflow.set_tags(tags)


def log_stage_outputs(run: StageRun, stage: str, root: Path) -> None:
    """What every stage's run holds once its block completed: headline numbers and curves.

    The headline numbers of the stage's metrics file (all of them for the report stage:
    :func:`~pipeline.tracking.headline.stage_headline`) not logged yet (knn and linear log
    theirs linked to the encoder's model), and the stage's curves as a table and a figure
    (:data:`~pipeline.tracking.curves.STAGE_CURVES`).
    """
    from pipeline.tracking.curves import log_stage_curves
    from pipeline.tracking.headline import stage_headline

    run.log_metrics({k: v for k, v in stage_headline(stage, root).items()
                     if k not in run.logged})
    log_stage_curves(run, stage, root)


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
        if not owner_dead(tags, me):
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
            off = StageRun(None)
            yield off
        if rank == 0:  # the record too: what a stage records of its process is no MLflow data
            write_json(root / RUNS_DIR / f"{stage}.json",
                       {**off.record, "stage": stage, "run_id": None})
        return

    with signals.handled():
        import mlflow
        from mlflow.tracking import MlflowClient

        uri = tracking_uri()
        check_reachable(uri)
        repo = repo_root()
        exp_id = open_experiment(uri, params.mlflow.experiment, repo)
        ensure_headline_view(MlflowClient(tracking_uri=uri), exp_id)  # the UI's default view
        mark_stale_runs(uri, exp_id, stage, repo)
        mlflow.set_tracking_uri(uri)
        tags = {"stage": stage, **git_state(root), **dvc_tags(), "repo.root": str(repo),
                **process_tags(), **(extra_tags or {})}
        for up in upstream:
            tags[f"upstream.{up}"] = read_run_id(up, root) or "unknown"
        run_name = f"{exp_name()}:{stage}"  # the runs table's first column
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
            check_started()  # an input edited while the stage ran: the run ends FAILED
            log_stage_outputs(handle, stage, root)
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
