"""The pretrained encoder as an MLflow model: logged, registered, scored, aliased.

* **Logged model.** The pretrain run logs the query backbone (``models/encoder.pt``, rebuilt as
  the ``embed`` stage rebuilds it, with the ``embed.pool_grid`` pooling) as its MLflow logged
  model ``encoder``, pytorch flavour, ``serialization_format="pt2"`` (``torch.export``: loading
  runs no pickle, which MLflow 3.17 refuses by default, and needs only torch). Signature:
  ``(-1, C, S, S)`` float32 normalised images -> ``(-1, D)`` float32 features, the rows of
  ``features/*.pt``. The input example is the first two test images after the evaluation
  transform: a batch of 1 would make ``torch.export`` fix the batch size at 1. ``encoder.json``
  goes with it (``extra_files``), and its preprocessing (size, mean, std) is the model's
  metadata.
* **Registry.** Every pretraining registers a new version of ``mlflow.registered_model``,
  tagged with the git commit, the DVC experiment name, the params digest, the experiment id and
  the md5 of ``encoder.pt`` (the hash ``dvc.lock`` records); alias :data:`NEWEST` moves to it.
  (MLflow reserves the alias ``latest``: ``models:/<name>/latest`` already names the newest
  version.)
* **Scores.** knn and linear link their top-1/top-5 to the logged model (``knn.top1``,
  ``linear.top1``, ...: columns of the experiment's Models view) and tag the version with them;
  embed and knn/linear list the model among their runs' inputs.
* **Champion.** After the linear probe, alias :data:`CHAMPION` points at the version of this
  experiment with the best ``linear.top1``; a tie keeps the current champion.
* **Failures** after training (the artifact store, the registry) are one warning line and a
  ``model.error`` / ``registry.error`` run tag: the stage still succeeds with its outputs, which
  cost up to hours and do not depend on MLflow.

Only :func:`choose_champion` and :func:`params_digest` work without an MLflow run; everything
else is a no-op for an inactive :class:`~pipeline.tracking.StageRun`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from pipeline.config import Params, to_dict
from pipeline.data.remote import ShardURL
from pipeline.tracking import StageRun, _init_lock, git_state, read_run_record, tracking_uri

log = logging.getLogger(__name__)

LOGGED_MODEL_NAME = "encoder"
CHAMPION = "champion"
NEWEST = "newest"
SCORE = "linear.top1"  # the version tag (and model metric) that ranks versions
EXPERIMENT_TAG = "experiment_id"
# The params that decide the trained weights: the pretrain stage's params in dvc.yaml.
TRAINING_SECTIONS = ("seed", "model", "moco", "augment", "pretrain")
EXAMPLE_IMAGES = 2


def params_digest(params: Params) -> str:
    """sha256 of the training params (:data:`TRAINING_SECTIONS`, canonical JSON), 64 hex chars.

    Two versions with the same digest were trained from the same params (the same recipe; the
    data and code may still differ: see the version's ``git.commit``).
    """
    tree = to_dict(params)
    sub = {k: tree[k] for k in TRAINING_SECTIONS}
    return hashlib.sha256(json.dumps(sub, sort_keys=True, default=str).encode()).hexdigest()


def choose_champion(scores: dict[int, float], current: int | None) -> int:
    """The version with the best score; the current champion keeps a tie.

    Args:
        scores: version -> linear top-1 (%), the versions eligible (this experiment's).
        current: the version the alias points at now (None: no champion yet).

    Returns:
        The champion version; among tied versions other than ``current``, the oldest (it got
        there first).

    Raises:
        ValueError: ``scores`` is empty.
    """
    if not scores:
        raise ValueError("choose_champion: no scored versions")
    best = max(scores.values())
    if current is not None and scores.get(current) == best:
        return current
    return min(v for v, s in scores.items() if s == best)


def _warn(run: StageRun, what: str, message: str) -> None:
    """One warning line + a run tag; the stage goes on."""
    line = " ".join(str(message).split())[:1000]
    log.warning("%s; the stage's outputs are kept", line)
    try:
        run.set_tags({f"{what}.error": line})
    except Exception as e:  # noqa: BLE001 - the warning above is what matters
        log.debug("could not tag the run: %s", e)


def _example_images(split: Path | ShardURL, image_size: int,
                    n: int) -> tuple[Any, dict[str, Any]]:
    """The split's first ``n`` images after the evaluation transform, and its manifest.

    Returns:
        (``(n, C, S, S)`` float32 images, the manifest).
    """
    from pipeline.data.loader import eval_loader, read_manifest
    from pipeline.data.views import build_eval_transform

    m = read_manifest(split)
    loader = eval_loader(split, transform=build_eval_transform(image_size, m["mean"], m["std"]),
                         batch_size=n, max_images=n)
    images, _, _ = next(iter(loader))
    return images, m


def log_encoder(*, encoder_path: Path, pool_grid: int, layer: int,
                example_split: Path | ShardURL, tags: dict[str, str]) -> str:
    """Log ``encoder.pt`` as the active run's MLflow logged model (pt2); return its model id.

    Args:
        encoder_path: ``models/encoder.pt`` (``encoder.json`` beside it).
        pool_grid: ``embed.pool_grid``: the model's features are the embed stage's.
        layer: ``embed.layer``: the stage whose map is pooled (the later ones are left out).
        example_split: the split whose first images are the input example (test).
        tags: tags of the logged model.

    Raises:
        Exception: whatever MLflow or ``torch.export`` raise (the caller reports it).
    """
    import mlflow
    import numpy as np
    import torch
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    from pipeline.evaluate.run.embed import load_encoder

    backbone, meta = load_encoder(encoder_path, pool_grid=pool_grid, layer=layer)
    backbone.eval()
    images, manifest = _example_images(example_split, int(meta["image_size"]), EXAMPLE_IMAGES)
    c, s = images.shape[1], images.shape[2]
    signature = ModelSignature(
        inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, c, s, s))]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, int(meta["num_features"])))]))
    preprocessing = {"image_size": int(meta["image_size"]), "mean": list(manifest["mean"]),
                     "std": list(manifest["std"]),
                     "transform": "pipeline.data.views.build_eval_transform"}
    info = mlflow.pytorch.log_model(
        backbone, name=LOGGED_MODEL_NAME, serialization_format="pt2", signature=signature,
        input_example=images.numpy(), extra_files=[str(encoder_path.with_suffix(".json"))],
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
        metadata={"encoder": meta, "preprocessing": preprocessing},
        params={f"encoder.{k}": v for k, v in meta.items()}, tags=tags)
    return info.model_id


def _version_tags(params: Params, run: StageRun, encoder_path: Path) -> dict[str, str]:
    import os

    git = git_state(Path.cwd())
    return {"git.commit": git["git.commit"], "git.dirty": git["git.dirty"],
            "dvc.exp_name": os.environ.get("DVC_EXP_NAME", "workspace"),
            "params.digest": params_digest(params), EXPERIMENT_TAG: str(run.experiment_id),
            "encoder.md5": hashlib.md5(encoder_path.read_bytes()).hexdigest()}


def publish_encoder(run: StageRun, *, params: Params, encoder_path: Path,
                    example_split: Path | ShardURL) -> None:
    """Log the encoder as the run's logged model, register a version, move :data:`NEWEST`.

    Records ``model_id``, ``model_uri``, ``registered_model`` and ``model_version`` in the
    run's ``runs/pretrain.json`` (``run.record``). Never raises for an MLflow failure: one
    warning line (see the module docstring).
    """
    if not run.active:
        return
    import mlflow
    from mlflow.tracking import MlflowClient

    tags = _version_tags(params, run, encoder_path)
    try:
        model_id = log_encoder(encoder_path=encoder_path,
                               pool_grid=params.embed.pool_grid, layer=params.embed.layer,
                               example_split=example_split,
                               tags=tags)
    except Exception as e:  # noqa: BLE001 - a tracking failure must not fail the training
        _warn(run, "model", f"could not log the encoder as an MLflow model: "
                            f"{type(e).__name__}: {e}")
        return
    run.record.update(model_id=model_id, model_uri=f"models:/{model_id}")
    name = params.mlflow.registered_model
    if not name:
        return
    try:
        version = mlflow.register_model(f"models:/{model_id}", name, tags=tags).version
        MlflowClient().set_registered_model_alias(name, NEWEST, str(version))
    except Exception as e:  # noqa: BLE001 - as above
        _warn(run, "registry", f"could not register model '{name}' in the MLflow registry: "
                               f"{type(e).__name__}: {e}")
        return
    run.record.update(registered_model=name, model_version=str(version))
    run.set_tags({"registry.version": f"{name}/{version}"})
    log.info("encoder registered as %s version %s (alias %s; models:/%s@%s)", name, version,
             NEWEST, name, NEWEST)


def link_encoder_input(run: StageRun) -> None:
    """List the upstream pretrain run's logged model among this run's inputs (embed)."""
    model_id = read_run_record("pretrain").get("model_id")
    if not run.active or not model_id:
        return
    from mlflow.entities import LoggedModelInput
    from mlflow.tracking import MlflowClient

    try:  # the client's log_inputs: the fluent one takes models on Databricks only
        MlflowClient().log_inputs(run.run_id, models=[LoggedModelInput(model_id=model_id)])
    except Exception as e:  # noqa: BLE001 - lineage only
        _warn(run, "model", f"could not link logged model {model_id}: {type(e).__name__}: {e}")


def attach_scores(run: StageRun, stage: str, metrics: dict[str, Any], *,
                  dataset: Any | None = None) -> dict[str, float]:
    """Link a stage's accuracies to the encoder's logged model and tag its version.

    Args:
        run: the active knn/linear run.
        stage: ``knn`` or ``linear``: the metric prefix (``knn.top1``).
        metrics: the stage's metrics; those whose name has ``top1``/``top5`` are linked.
        dataset: the test split's ``mlflow.data`` dataset (from ``log_shards``).

    Returns:
        The linked metrics (``{}`` when nothing was linked).
    """
    record = read_run_record("pretrain")
    model_id = record.get("model_id")
    if not run.active or not model_id:
        return {}
    scores = {f"{stage}.{k}": float(v) for k, v in metrics.items()
              if ("top1" in k or "top5" in k) and isinstance(v, (int, float))}
    try:
        run.log_metrics(scores, model_id=model_id, dataset=dataset)
        if record.get("model_version"):
            from mlflow.tracking import MlflowClient

            client = MlflowClient()
            for k, v in scores.items():
                client.set_model_version_tag(record["registered_model"],
                                             record["model_version"], k, f"{v:g}")
    except Exception as e:  # noqa: BLE001 - the stage's own metrics are already logged
        _warn(run, "model", f"could not attach {stage} metrics to logged model {model_id}: "
                            f"{type(e).__name__}: {e}")
        return {}
    return scores


def update_champion(run: StageRun) -> int | None:
    """Point :data:`CHAMPION` at this experiment's version with the best ``linear.top1``.

    Call after :func:`attach_scores` of the linear stage (which tagged this version). Runs under
    the database's file lock, so parallel experiments on one SQLite file do not interleave.

    Returns:
        The champion version, None when there is nothing to rank or the registry failed.
    """
    record = read_run_record("pretrain")
    name, version = record.get("registered_model"), record.get("model_version")
    if not run.active or not name or not version:
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    try:
        with _init_lock(uri):
            client = MlflowClient(tracking_uri=uri)
            versions = client.search_model_versions(f"name = '{name}'")
            scores = {int(v.version): float(v.tags[SCORE]) for v in versions
                      if v.tags.get(EXPERIMENT_TAG) == str(run.experiment_id) and SCORE in v.tags}
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
    except Exception as e:  # noqa: BLE001 - the stage's own results are written
        _warn(run, "registry", f"could not move alias '{CHAMPION}' of model '{name}': "
                               f"{type(e).__name__}: {e}")
        return None
    moved = "kept" if champion == current else f"moved from {current}"
    log.info("%s@%s = version %d (linear top-1 %.2f; %s; version %s scored %.2f)", name,
             CHAMPION, champion, scores[champion], moved, version, scores.get(int(version), -1))
    run.set_tags({"registry.champion": f"{name}/{champion}"})
    return champion
