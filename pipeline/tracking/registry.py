"""The pretrained encoder as an MLflow model: logged, registered, trusted, scored, aliased.

* **Logged model**: :mod:`pipeline.tracking.model` (an ordinary ``nn.Module``, no project code
  needed to load it).
* **Registry.** Every pretraining registers a new version of ``mlflow.registered_model``,
  tagged with the git commit, the DVC experiment name, the params digest, the training
  fingerprint and the md5 of ``encoder.pt`` (the hash ``dvc.lock`` records); alias
  :data:`NEWEST` moves to it.
  (MLflow reserves the alias ``latest``: ``models:/<name>/latest`` already names the newest
  version.)
* **Trust.** The evaluation stages use the version whose ``encoder.md5`` tag is the workspace
  encoder's (:func:`trusted_encoder`): ``runs/pretrain.json`` may come from DVC's run cache
  and name a version of a database that is gone. No such version: the stage registers the
  encoder again and says so in one line.
* **Scores.** knn and linear link their headline top-1 to the logged model (``top1.knn``,
  ``top1.linear``: columns of the experiment's Models view) and tag the version with it
  (``knn.top1``, ``linear.top1``), removing their older tags: a version's tags are its current
  ones. embed and knn/linear list the model among their runs' inputs.
* **Champion.** After the linear probe, alias :data:`CHAMPION` points at the version with the
  best ``linear.top1`` among ALL versions of the registered model (the alias is registry-wide,
  so is the election); a tie keeps the current champion.
* **Failures** of the tracking side (:func:`optional_failures`: the registry or database, the
  server unreachable, the artifact store) are one warning line and a ``model.error`` /
  ``registry.error`` run tag: the stage still succeeds with its outputs, which cost up to
  hours and do not depend on MLflow. Anything else (a bug) fails the stage.

The functions that take a :class:`~pipeline.tracking.StageRun` are no-ops for an inactive one;
the others (:func:`choose_champion`, :func:`plain_encoder`, ...) need no
MLflow run.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.atomic import read_json
from pipeline.config import Params
from pipeline.data.remote import ShardURL
from pipeline.errors import InputError
from pipeline.evaluate.verdict import TAG as VERDICT_TAG
from pipeline.stage_inputs import check_started
from pipeline.tracking.headline import headline_from
from pipeline.tracking.model import log_encoder
from pipeline.tracking.provenance import exp_name, git_state
from pipeline.tracking.runs import StageRun, read_run_record
from pipeline.tracking.store import TrackingError, error_summary, init_lock, tracking_uri
from pipeline.train.training_input import TrainingInput, params_digest

log = logging.getLogger(__name__)


CHAMPION = "champion"


NEWEST = "newest"


SCORE = "linear.top1"  # the version tag (and model metric) that ranks versions


MD5_TAG = "encoder.md5"


FINGERPRINT_TAG = "training.fingerprint"  # TrainingInput.fingerprint: params, image, data, code


@dataclass(frozen=True)
class EncoderVersion:
    """The MLflow model of the workspace encoder.

    Attributes:
        model_id: the logged model (``models:/<model_id>``).
        name: the registered model; None when registering is off (``mlflow.registered_model:
            ""``).
        version: its version, None likewise.
    """

    model_id: str
    name: str | None = None
    version: str | None = None


def file_md5(path: Path) -> str:
    """md5 of a file's bytes, 32 hex chars (what ``dvc.lock`` records for it)."""
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def choose_champion(scores: dict[int, float], current: int | None) -> int:
    """The version with the best score; the current champion keeps a tie.

    Args:
        scores: version -> linear top-1 (%), every scored version of the registered model.
        current: the version the alias points at now (None: no champion yet).

    Returns:
        The champion version; among tied versions other than ``current``, the oldest (it got
        there first).

    Raises:
        ValueError: ``scores`` is empty.
    """
    if not scores:
        raise InputError("choose_champion: no scored versions")
    best = max(scores.values())
    if current is not None and scores.get(current) == best:
        return current
    return min(v for v, s in scores.items() if s == best)


def optional_failures() -> tuple[type[BaseException], ...]:
    """The failures of the tracking side that must not fail a stage (a warning instead).

    MLflow's own errors (the registry or database refused, a server that does not answer:
    MLflow raises ``MlflowException`` after its retries), SQLAlchemy's, the file lock of the
    database (:class:`~pipeline.tracking.TrackingError`), and I/O: a full or unreachable
    artifact store (``OSError``, which ``requests``' connection errors are too) and boto's
    errors for an S3 store. A bug (``TypeError``, ``KeyError``, ...) is not one of them.
    """
    from mlflow.exceptions import MlflowException
    from requests import RequestException
    from sqlalchemy.exc import SQLAlchemyError

    kinds: tuple[type[BaseException], ...] = (MlflowException, SQLAlchemyError, TrackingError,
                                              OSError, RequestException)
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return kinds
    return (*kinds, BotoCoreError, ClientError)


def _warn(run: StageRun, what: str, message: str) -> None:
    """One warning line + a run tag; the stage goes on."""
    line = " ".join(str(message).split())[:1000]
    log.warning("%s; the stage's outputs are kept", line)
    try:
        run.set_tags({f"{what}.error": line})
    except optional_failures() as e:  # the warning above is what matters
        log.debug("could not tag the run: %s", error_summary(e))


def _version_tags(params: Params, encoder_path: Path,
                  training: TrainingInput | None = None) -> dict[str, str]:
    """A version's tags from its registration: where it comes from and what it is.

    The git commit and dirty flag, the DVC experiment, the recipe (``params.digest``), the
    encoder's bytes (``encoder.md5``), the whole training input (``training.fingerprint``);
    the scores join later (:func:`attach_scores`). ``training.fingerprint`` only where the
    training input is known: the pretrain stage, not an evaluation stage that registers an
    encoder no version holds. ``verdict``: the training's verdict (:mod:`pipeline.evaluate.
    verdict`) where ``encoder.json`` holds one.
    """
    git = git_state(Path.cwd())
    known = {FINGERPRINT_TAG: training.fingerprint} if training is not None else {}
    said = (read_json(encoder_path.with_suffix(".json")) or {}).get("verdict")  # pretrain's
    known.update({VERDICT_TAG: said} if said else {})
    return {"git.commit": git["git.commit"], "git.dirty": git["git.dirty"],
            "dvc.exp_name": exp_name(),
            "params.digest": params_digest(params), MD5_TAG: file_md5(encoder_path), **known}


def _log_and_register(run: StageRun, *, params: Params, encoder_path: Path,
                      example_split: Path | ShardURL,
                      training: TrainingInput | None = None) -> EncoderVersion | None:
    """Log the encoder as the run's logged model and register a version (None: failed).

    An encoder whose bytes a version of the registered model already holds (the same
    ``encoder.md5``: a finished checkpoint exported again after a params change that trains
    nothing, such as ``pretrain.log_every_steps``) is not registered twice: that version is
    returned and :data:`NEWEST` moves to it.
    """
    tags = _version_tags(params, encoder_path, training)
    same = _registered_with_md5(run, params.mlflow.registered_model, tags[MD5_TAG])
    if same is not None:
        return same
    try:
        model_id = log_encoder(encoder_path=encoder_path,
                               pool_grid=params.embed.pool_grid, layer=params.embed.layer,
                               example_split=example_split, tags=tags)
    except optional_failures() as e:  # a tracking failure must not fail the stage
        _warn(run, "model", f"could not log the encoder as an MLflow model: {error_summary(e)}")
        return None
    return _register(run, model_id, params.mlflow.registered_model, tags)


def _registered_with_md5(run: StageRun, name: str, md5: str) -> EncoderVersion | None:
    """The newest version of ``name`` holding these encoder bytes, now :data:`NEWEST`; or None."""
    from mlflow.tracking import MlflowClient

    if not name:
        return None
    try:
        client = MlflowClient()
        v = _newest_with_md5(client, name, md5)
        if v is None:
            return None
        client.set_registered_model_alias(name, NEWEST, str(v.version))
    except optional_failures() as e:
        _warn(run, "registry", f"could not search model '{name}' in the MLflow registry: "
                               f"{error_summary(e)}")
        return None
    log.info("these encoder bytes are already version %s of '%s' (same %s): not registered "
             "again", v.version, name, MD5_TAG)
    run.set_tags({"registry.version": f"{name}/{v.version}"})
    return _encoder_version(v)


def _register(run: StageRun, model_id: str, name: str, tags: dict[str, str]) -> EncoderVersion:
    """Register logged model ``model_id`` as a new version of ``name``; move :data:`NEWEST`.

    Returns:
        The version; without one (``name`` empty, or the registry failed: one warning line)
        just the logged model.
    """
    import mlflow
    from mlflow.tracking import MlflowClient

    if not name:
        return EncoderVersion(model_id)
    try:
        version = str(mlflow.register_model(f"models:/{model_id}", name, tags=tags).version)
        MlflowClient().set_registered_model_alias(name, NEWEST, version)
    except optional_failures() as e:
        _warn(run, "registry", f"could not register model '{name}' in the MLflow registry: "
                               f"{error_summary(e)}")
        return EncoderVersion(model_id)
    run.set_tags({"registry.version": f"{name}/{version}"})
    return EncoderVersion(model_id, name, version)


def publish_encoder(run: StageRun, *, params: Params, training: TrainingInput,
                    encoder_path: Path, example_split: Path | ShardURL) -> None:
    """Log the encoder as the run's logged model, register a version, move :data:`NEWEST`.

    The version's tags name its recipe (``params.digest``) and its whole training input
    (``training.fingerprint``, :class:`~pipeline.train.training_input.TrainingInput`).

    Records ``model_id``, ``model_uri``, ``registered_model`` and ``model_version`` in the
    run's ``runs/pretrain.json`` (``run.record``). An :func:`optional_failures` failure is one
    warning line (see the module docstring).

    Raises:
        InputsChanged: an input of the stage changed while it ran
            (:func:`~pipeline.stage_inputs.check_started`).
    """
    if not run.active:
        return
    check_started()  # nothing registered for a stage whose inputs changed while it ran
    encoder = _log_and_register(run, params=params, encoder_path=encoder_path,
                                example_split=example_split, training=training)
    if encoder is None:
        return
    run.record.update(model_id=encoder.model_id, model_uri=f"models:/{encoder.model_id}")
    if encoder.version is None:
        return
    run.record.update(registered_model=encoder.name, model_version=encoder.version)
    log.info("encoder registered as %s version %s (alias %s; models:/%s@%s)", encoder.name,
             encoder.version, NEWEST, encoder.name, NEWEST)


def trusted_encoder(run: StageRun, *, params: Params, encoder_path: Path,
                    example_split: Path | ShardURL) -> EncoderVersion | None:
    """The MLflow model of the workspace encoder: found by its md5, else registered again.

    A version is trusted only when its ``encoder.md5`` tag is ``encoder_path``'s md5.
    ``runs/pretrain.json`` names the version its pretraining registered, but DVC restores that
    file from its run cache or a remote too, and the database it was written against may be
    gone (``mlflow.db`` deleted: its version 2 is then another encoder, or none). So, in order:
    the recorded version if its md5 matches; the newest version with that md5 (by tag); a
    logged model with that md5 (the recorded one, else the newest of this experiment),
    registered as a new version; else this run logs ``encoder_path`` and registers it. The
    last two say so in one warning line. With ``mlflow.registered_model: ""`` only logged
    models are looked up. The search and the registration run under the database's file lock,
    so parallel stages register an encoder once.

    Args:
        run: the active evaluation run (embed, knn, linear).
        params: the stage's params (registered model name, pooling, the version's tags).
        encoder_path: ``models/encoder.pt``.
        example_split: the split whose first images are the input example, if logging.

    Returns:
        The logged model and version (no version when registering is off or failed); None when
        the run is inactive or the tracking side failed (one warning line).
    """
    if not run.active:
        return None
    from mlflow.tracking import MlflowClient

    md5, record = file_md5(encoder_path), read_run_record("pretrain")
    name = params.mlflow.registered_model
    try:
        with init_lock(tracking_uri()):
            client = MlflowClient()
            found = _version_by_md5(client, name, md5, record) if name else None
            logged = None if found else _logged_model_by_md5(client, str(run.experiment_id),
                                                             md5, record)
            if found or (logged and not name):
                return found or EncoderVersion(logged)
            why = _why_untrusted(client, name, record)
            encoder = (_register(run, logged, name, _logged_tags(client, logged)) if logged
                       else _log_and_register(run, params=params, encoder_path=encoder_path,
                                              example_split=example_split))
    except optional_failures() as e:
        _warn(run, "registry", f"could not look up {encoder_path} (md5 {md5}) in the MLflow "
                               f"registry: {error_summary(e)}")
        return None
    if encoder is not None and (encoder.version or not name):  # else a warning said why not
        again = (f"registered logged model {logged} as version {encoder.version} of '{name}'"
                 if logged else
                 f"registered it again as version {encoder.version} of '{name}'" if name
                 else f"logged it again as model {encoder.model_id}")
        log.warning("%s (md5 %s) %s: %s", encoder_path, md5, why, again)
    return encoder


def _logged_tags(client: Any, model_id: str) -> dict[str, str]:
    """The version tags a logged model was given when logged (see :func:`_version_tags`)."""
    keys = ("git.commit", "git.dirty", "dvc.exp_name", "params.digest", MD5_TAG, VERDICT_TAG)
    tags = client.get_logged_model(model_id).tags
    return {k: tags[k] for k in keys if k in tags}


def _version_by_md5(client: Any, name: str, md5: str,
                    record: dict[str, Any]) -> EncoderVersion | None:
    """The recorded version if its md5 matches, else the newest version with that md5."""
    from mlflow.exceptions import MlflowException

    if record.get("registered_model") == name and record.get("model_version"):
        try:
            v = client.get_model_version(name, str(record["model_version"]))
        except MlflowException:
            v = None  # not in this database
        if v is not None and v.tags.get(MD5_TAG) == md5:
            return _encoder_version(v)
    newest = _newest_with_md5(client, name, md5)
    if newest is None:
        return None
    if record.get("model_version"):
        log.info("runs/pretrain.json names version %s of '%s', not this encoder's: using "
                 "version %s (same %s)", record["model_version"], name, newest.version, MD5_TAG)
    return _encoder_version(newest)


def _newest_with_md5(client: Any, name: str, md5: str) -> Any:
    """The newest ``ModelVersion`` of ``name`` tagged with encoder md5 ``md5``, or None."""
    same = client.search_model_versions(f"name = '{name}' and tags.`{MD5_TAG}` = '{md5}'")
    return max(same, key=lambda v: int(v.version)) if same else None


def _encoder_version(v: Any) -> EncoderVersion:
    """An :class:`EncoderVersion` from MLflow's ``ModelVersion`` (source ``models:/<id>``)."""
    model_id = getattr(v, "model_id", None) or str(v.source).removeprefix("models:/")
    return EncoderVersion(model_id, v.name, str(v.version))


def _logged_model_by_md5(client: Any, experiment_id: str, md5: str,
                         record: dict[str, Any]) -> str | None:
    """The recorded logged model if its md5 matches, else this experiment's newest with it."""
    from mlflow.exceptions import MlflowException

    if record.get("model_id"):
        try:
            m = client.get_logged_model(record["model_id"])
        except MlflowException:
            m = None
        if m is not None and m.tags.get(MD5_TAG) == md5:
            return m.model_id
    same = client.search_logged_models(experiment_ids=[experiment_id],
                                       filter_string=f"tags.`{MD5_TAG}` = '{md5}'")
    return max(same, key=lambda m: m.creation_timestamp).model_id if same else None


def _why_untrusted(client: Any, name: str, record: dict[str, Any]) -> str:
    """Why no version could be trusted, for the warning line (a clause)."""
    from mlflow.exceptions import MlflowException

    kind, ref = (("version", record.get("model_version")) if name
                 else ("logged model", record.get("model_id")))
    where = f"'{name}'" if name else "this experiment"
    if not ref:
        return f"has no {kind} in {where} and runs/pretrain.json names none"
    try:
        theirs = (client.get_model_version(name, str(ref)).tags if name
                  else client.get_logged_model(ref).tags).get(MD5_TAG, "none")
    except MlflowException:
        return (f"has no {kind} in {where}; runs/pretrain.json names {kind} {ref}, which "
                "this database does not have")
    return (f"has no {kind} in {where}; runs/pretrain.json names {kind} {ref}, whose "
            f"{MD5_TAG} is {theirs}")


def link_encoder_input(run: StageRun, encoder: EncoderVersion | None) -> None:
    """List the encoder's logged model among this run's inputs (embed)."""
    if not run.active or encoder is None:
        return
    from mlflow.entities import LoggedModelInput
    from mlflow.tracking import MlflowClient

    try:  # the client's log_inputs: the fluent one takes models on Databricks only
        MlflowClient().log_inputs(run.run_id,
                                  models=[LoggedModelInput(model_id=encoder.model_id)])
    except optional_failures() as e:  # lineage only
        _warn(run, "model", f"could not link logged model {encoder.model_id}: "
                            f"{error_summary(e)}")


def score_tags(stage: str, metrics: dict[str, Any]) -> dict[str, str]:
    """The version tags a stage's scores give: ``<stage>.top1`` (``knn.top1``, ``linear.top1``).

    Only the top-1 of the stage's own protocol: the version page shows a handful of tags, and
    the stage's other numbers are in its run (linked from the version's source run).
    """
    top1 = metrics.get("top1")
    if isinstance(top1, bool) or not isinstance(top1, (int, float)):
        return {}
    return {f"{stage}.top1": f"{float(top1):g}"}


def attach_scores(run: StageRun, stage: str, metrics: dict[str, Any], *,
                  encoder: EncoderVersion | None, dataset: Any | None = None) -> dict[str, float]:
    """Log a stage's headline numbers linked to the encoder's model; tag its version.

    The headline numbers of the stage's metrics file (``top1.knn``, ``top1.linear``:
    :mod:`pipeline.tracking.headline`) are logged with ``model_id`` (columns of the Models
    view) and ``dataset``; without an encoder model, plainly. The version's tags of this stage
    become exactly :func:`score_tags`: any other tag named ``<stage>.*`` (left by an earlier
    evaluation, e.g. ``knn.select_val_top1`` from a run that chose k on a validation split, or
    by older code) is deleted, so every tag of a version is its current evaluation's.

    Args:
        run: the active knn/linear run.
        stage: ``knn`` or ``linear``: its metrics file is ``metrics/<stage>.json``.
        metrics: the stage's metrics, as written to that file.
        encoder: the workspace encoder's model (:func:`trusted_encoder`).
        dataset: the test split's ``mlflow.data`` dataset (from ``log_shards``).

    Returns:
        The headline numbers logged (``{}`` for an inactive run or when the tracking side
        failed: one warning line).

    Raises:
        InputsChanged: an input of the stage changed while it ran
            (:func:`~pipeline.stage_inputs.check_started`).
    """
    check_started()  # no version tagged for a stage whose inputs changed while it ran
    if not run.active:
        return {}
    scores = headline_from(f"metrics/{stage}.json", metrics)
    linked = encoder.model_id if encoder is not None else None
    try:
        run.log_metrics(scores, model_id=linked, dataset=dataset)
        if encoder is not None and encoder.version is not None:
            _retag_version(encoder, stage, score_tags(stage, metrics))
    except optional_failures() as e:  # the stage's own metrics are already logged
        _warn(run, "model", f"could not attach {stage} metrics to logged model "
                            f"{linked or '(none)'}: {error_summary(e)}")
        return {}
    return scores


def _retag_version(encoder: EncoderVersion, stage: str, tags: dict[str, str]) -> None:
    """Set ``tags`` on the version; delete its other ``<stage>.*`` tags."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    old = client.get_model_version(encoder.name, encoder.version).tags
    for k in sorted(old):
        if k.startswith(f"{stage}.") and k not in tags:
            client.delete_model_version_tag(encoder.name, encoder.version, k)
    for k, v in tags.items():
        client.set_model_version_tag(encoder.name, encoder.version, k, v)


def update_champion(run: StageRun, encoder: EncoderVersion | None) -> int | None:
    """Point :data:`CHAMPION` at the version with the best ``linear.top1`` of the whole model.

    Every scored version of the registered model competes, whichever experiment or clone
    registered it: the alias is the registry's, so is the election (a clone electing among its
    own versions moved it to a worse one). Call after :func:`attach_scores` of the linear stage
    (which tagged ``encoder``'s version). Runs under the database's file lock, so parallel
    experiments on one SQLite file do not interleave.

    Returns:
        The champion version, None when there is nothing to rank or the registry failed.

    Raises:
        InputsChanged: an input of the stage changed while it ran
            (:func:`~pipeline.stage_inputs.check_started`).
    """
    check_started()  # no champion elected by a stage whose inputs changed while it ran
    if not run.active or encoder is None or encoder.version is None:
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    name, uri = encoder.name, tracking_uri()
    try:
        with init_lock(uri):
            client = MlflowClient(tracking_uri=uri)
            versions = client.search_model_versions(f"name = '{name}'")
            scores = {int(v.version): float(v.tags[SCORE]) for v in versions if SCORE in v.tags}
            if not scores:
                return None
            try:
                current: int | None = int(client.get_model_version_by_alias(name,
                                                                            CHAMPION).version)
            except MlflowException:
                current = None
            champion = choose_champion(scores, current)
            if champion != current:
                client.set_registered_model_alias(name, CHAMPION, str(champion))
    except optional_failures() as e:  # the stage's own results are written
        _warn(run, "registry", f"could not move alias '{CHAMPION}' of model '{name}': "
                               f"{error_summary(e)}")
        return None
    moved = "kept" if champion == current else f"moved from {current}"
    log.info("%s@%s = version %d (linear top-1 %.2f; %s; version %s scored %.2f)", name,
             CHAMPION, champion, scores[champion], moved, encoder.version,
             scores.get(int(encoder.version), -1))
    run.set_tags({"registry.champion": f"{name}/{champion}"})
    return champion
