"""Read the pipeline's outputs into one typed structure, :class:`RunOutputs`.

Every input of the report is optional: a file that is missing (or cannot be parsed) becomes
``None`` and the report says "not available" for it. Nothing here draws or formats; the
sections (:mod:`pipeline.report.sections`) only look at the fields of :class:`RunOutputs`,
except for the few shard images that the retrieval figure picks, which they load with
:func:`load_shard_images`.

Inputs, all relative to the repo root::

    eval/metrics/{pretrain,data_insights,embed,baselines,knn,linear}.json   Metrics
    eval/metrics/label_efficiency.json                   the label-efficiency curve
    eval/data_insights.json                              near-duplicates and outliers
    plots/{pretrain,knn_monitor,labelfree,linear}.tsv    columns of floats
    plots/linear_val.tsv                                 the probe's val_acc, if measured
    eval/{knn,linear}_details.json                       EvalDetails
    features/{train,test}.pt                             Embeddings
    runs/<stage>.json                                    RunRecord
    dvc.lock                                             LockRow list
    <data.shards_dir>/test/manifest.json                 class names
"""

from __future__ import annotations

import contextlib
import logging
import math
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from pipeline.atomic import read_json
from pipeline.data.external import IMAGE_MEMBERS, open_image
from pipeline.data.manifest import Manifest, ShardError, read_manifest
from pipeline.data.remote import is_url, shards_location
from pipeline.data.shards import member_key

log = logging.getLogger(__name__)

TRACKED_STAGES = ("build_shards", "pretrain", "data_insights", "embed", "baselines", "knn",
                  "linear", "label_efficiency", "select_labels")
# Every number of each stage (eval/metrics/; metrics/<stage>.json holds only its headline)
METRICS_FILES = {  # metric-name prefix -> metrics file (relative to the repo root)
    "pretrain": "eval/metrics/pretrain.json",
    "data_insights": "eval/metrics/data_insights.json",
    "embed": "eval/metrics/embed.json",
    "baselines": "eval/metrics/baselines.json",
    "knn": "eval/metrics/knn.json",
    "linear": "eval/metrics/linear.json",
}
LABEL_EFFICIENCY_FILE = "eval/metrics/label_efficiency.json"  # nested: not among the final metrics
SELECTION_FILE = "eval/metrics/selection.json"  # nested too: its time and counts, for the cost
PLOT_FILES = {  # curve name -> TSV (relative to the repo root)
    "pretrain": "plots/pretrain.tsv",
    "knn_monitor": "plots/knn_monitor.tsv",
    "labelfree": "plots/labelfree.tsv",
    "linear": "plots/linear.tsv",
}
LINEAR_VAL_FILE = "plots/linear_val.tsv"  # its val_acc joins the "linear" columns
EVALUATIONS = ("knn", "linear")  # eval/<name>_details.json

Columns = Mapping[str, np.ndarray]  # TSV column name -> (R,) float64 values


@dataclass(frozen=True)
class Metrics:
    """The finite numbers of one stage's metrics JSON (top level only).

    Attributes:
        values: metric name -> value; booleans, strings, nested objects, NaN and Inf are left
            out, so every value can be formatted as a number.
    """

    values: Mapping[str, float]

    def get(self, key: str) -> float | None:
        """The value of ``key``, or None when the file does not hold a finite number for it."""
        return self.values.get(key)


def metric(m: Metrics | None, key: str) -> float | None:
    """``m[key]`` as a finite float; None when the file or the number is missing."""
    return None if m is None else m.get(key)


@dataclass(frozen=True)
class EvalDetails:
    """``eval/<name>_details.json`` of an evaluation stage (kNN or linear probe).

    Attributes:
        confusion: (C, C) int64 counts, rows = true class, columns = predicted class.
        class_names: (C,) names in class-index order (the indices as text when not recorded).
        per_class_accuracy: (C,) top-1 accuracy in percent (NaN for a class absent from the
            test set), or None when the file does not hold one value per class.
    """

    confusion: np.ndarray
    class_names: list[str]
    per_class_accuracy: list[float] | None


@dataclass(frozen=True)
class Embeddings:
    """A features file of the embed stage.

    Attributes:
        features: (N, D) float frozen features.
        labels: (N,) int64 class indices.
        keys: (N,) sample keys, the names of the images in the shards.
    """

    features: Tensor
    labels: Tensor
    keys: list[str]


@dataclass(frozen=True)
class RunRecord:
    """``runs/<stage>.json``: the MLflow run of the stage's last execution.

    Attributes:
        run_id: the MLflow run id, None when the stage ran with MLflow disabled.
        experiment_id: the MLflow experiment id ("" when not recorded).
        tracking_uri: where the run was logged (may hold credentials: redact before showing).
        ran: how the stage's process ran, as recorded under ``ran`` (pretrain:
            :func:`pipeline.train.engine.how_it_ran`: precision, threads, machine, versions);
            empty when not recorded.
    """

    run_id: str | None
    experiment_id: str
    tracking_uri: str | None
    ran: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LockRow:
    """One output recorded in ``dvc.lock``."""

    stage: str
    path: str
    md5: str


@dataclass(frozen=True)
class RunOutputs:
    """Everything the report shows, read once from the repo root. ``None`` = not available.

    Attributes:
        metrics: stage (:data:`METRICS_FILES`, and ``label_efficiency``: its top-level numbers)
            -> its metrics.
        plots: curve name (:data:`PLOT_FILES`) -> TSV columns.
        details: evaluation (:data:`EVALUATIONS`) -> its details.
        features: ``"train"`` / ``"test"`` -> embeddings.
        test_class_names: class names of the test-shard manifest.
        split_sizes: ``"train"`` / ``"test"`` -> images in that split's manifest (None when
            it cannot be read).
        runs: stage (:data:`TRACKED_STAGES`) -> its run record.
        dvc_lock: the outputs recorded in ``dvc.lock``, in file order.
        shards_are_url: ``data.shards_dir`` is a URL (retrieval, which reads local shards, is
            skipped).
        shards_dir: the shard directory (``<root>/<data.shards_dir>``); retrieval images are
            read from its ``train`` and ``test`` splits.
        label_efficiency: ``eval/metrics/label_efficiency.json`` (:func:`read_label_efficiency`).
        data_insights: ``eval/data_insights.json`` (:func:`read_data_insights`).
        root: the repo root (shard paths recorded relative to it are read from there).
        no_labels: why the evaluation stages were skipped (``runs/check_eval.json``: no
            labelled train or test images), else None.
    """

    metrics: Mapping[str, Metrics | None]
    plots: Mapping[str, Columns | None]
    details: Mapping[str, EvalDetails | None]
    features: Mapping[str, Embeddings | None]
    test_class_names: list[str] | None
    runs: Mapping[str, RunRecord | None]
    dvc_lock: list[LockRow] | None
    shards_dir: Path
    shards_are_url: bool = False
    label_efficiency: Mapping[str, Any] | None = None
    data_insights: Mapping[str, Any] | None = None
    root: Path = Path(".")
    split_sizes: Mapping[str, int | None] = field(default_factory=dict)
    no_labels: str | None = None


def read_outputs(root: Path, shards_dir: str) -> RunOutputs:
    """Read every report input below ``root``.

    Args:
        root: the repo root every input path is relative to.
        shards_dir: ``data.shards_dir``, relative to ``root``.

    Returns:
        The :class:`RunOutputs`; missing or unreadable files are None.
    """
    root = Path(root)
    # published shards: class names and sizes from the URL manifests
    base = shards_location(shards_dir) if is_url(shards_dir) else root / shards_dir
    manifests = {split: _manifest(base / split) for split in ("train", "test")}
    test = manifests["test"]  # none: no test split (yet) or unreadable; indices as names
    names = None if test is None else [str(n) for n in test.class_names]
    return RunOutputs(
        metrics={s: read_metrics(root / rel) for s, rel in
                 {**METRICS_FILES, "label_efficiency": LABEL_EFFICIENCY_FILE,
                  "select_labels": SELECTION_FILE}.items()},
        plots=_with_val(root, {name: read_tsv(root / rel) for name, rel in PLOT_FILES.items()}),
        details={e: read_details(root / f"eval/{e}_details.json") for e in EVALUATIONS},
        features={s: load_features(root / f"features/{s}.pt") for s in ("train", "test")},
        test_class_names=names,
        runs={s: read_run(root / "runs" / f"{s}.json") for s in TRACKED_STAGES},
        dvc_lock=read_dvc_lock(root / "dvc.lock"),
        shards_dir=root / shards_dir,
        shards_are_url=is_url(shards_dir),
        label_efficiency=read_label_efficiency(root / LABEL_EFFICIENCY_FILE),
        data_insights=read_data_insights(root / "eval/data_insights.json"),
        root=root,
        split_sizes={s: None if m is None else m.num_samples for s, m in manifests.items()},
        no_labels=(read_json(root / "runs/check_eval.json") or {}).get("skipped"),
    )


def _manifest(split_dir: Any) -> Manifest | None:
    """A split's manifest, or None when it is missing or unreadable."""
    try:
        return read_manifest(split_dir)
    except ShardError:
        return None


def read_label_efficiency(path: Path) -> dict[str, Any] | None:
    """``eval/metrics/label_efficiency.json`` when its curve is whole, else None (with a log line).

    Whole: ``curve[kind][probe][n]`` holds finite ``mean`` and ``std`` for every kind, both
    probes and the same ``n`` everywhere. The points come back in increasing ``n`` (the file's
    keys are text, which JSON writers sort as text: "1", "10", "100", "2").
    """
    data = read_json(path)
    try:
        curve = data["curve"]
        ns = {tuple(points) for probes in curve.values() for points in probes.values()}
        ok = len(ns) == 1 and all(
            _finite(pt["mean"]) and _finite(pt["std"]) for probes in curve.values()
            for probe in ("knn", "linear") for pt in probes[probe].values())
        for probes in curve.values():
            for probe, points in probes.items():
                probes[probe] = dict(sorted(points.items(), key=lambda kv: int(kv[0])))
    except (TypeError, KeyError, AttributeError, ValueError):
        ok = False
    return _if_whole(path, data, ok, "a whole label-efficiency curve")


def _with_val(root: Path, plots: dict[str, Columns | None]) -> dict[str, Columns | None]:
    """``plots`` with :data:`LINEAR_VAL_FILE`'s ``val_acc`` added to the ``linear`` columns.

    Only when it holds one row per row of ``plots/linear.tsv`` (the same epochs).
    """
    lin, val = plots.get("linear"), read_tsv(root / LINEAR_VAL_FILE)
    if lin is not None and val is not None and "val_acc" in val and "epoch" in lin \
            and np.array_equal(val.get("epoch"), lin["epoch"]):
        plots["linear"] = {**lin, "val_acc": val["val_acc"]}
    return plots


def _if_whole(path: Path, data: Any, ok: bool, what: str) -> Any:
    """``data`` when its checks passed (``ok``), else None, with a log line if the file was read."""
    if ok:
        return data
    if data is not None:
        log.warning("%s: not %s; the report leaves it out", path, what)
    return None


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_metrics(path: Path) -> Metrics | None:
    """A stage's metrics file, or None when it is missing, unreadable or an empty object."""
    obj = read_json(path)
    if not obj:
        return None
    return Metrics({k: float(v) for k, v in obj.items() if _finite(v)})


def read_tsv(path: Path) -> dict[str, np.ndarray] | None:
    """Columns of a TSV with a header row, as float arrays (empty / non-numeric cells = nan).

    Args:
        path: the TSV file.

    Returns:
        column name -> (R,) float64 values, or None when the file is missing or has no header.
    """
    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    except FileNotFoundError:
        return None
    if not lines:
        return None
    header = lines[0].split("\t")
    values = np.full((len(lines) - 1, len(header)), np.nan)  # (R, columns)
    for r, line in enumerate(lines[1:]):
        for c, cell in enumerate(line.split("\t")[: len(header)]):
            with contextlib.suppress(ValueError):
                values[r, c] = float(cell)
    return {name: values[:, c] for c, name in enumerate(header)}


def read_details(path: Path) -> EvalDetails | None:
    """``eval/<name>_details.json``, or None when missing or without a confusion matrix."""
    det = read_json(path)
    if det is None or "confusion_matrix" not in det:
        return None
    cm = np.asarray(det["confusion_matrix"], dtype=np.int64)  # (C, C)
    names = [str(n) for n in det.get("class_names") or range(len(cm))]
    acc = det.get("per_class_accuracy")
    per_class = None
    if isinstance(acc, list) and len(acc) == len(names):
        per_class = [math.nan if a is None else float(a) for a in acc]
    return EvalDetails(confusion=cm, class_names=names, per_class_accuracy=per_class)


def read_run(path: Path) -> RunRecord | None:
    """``runs/<stage>.json``, or None when missing."""
    run = read_json(path)
    if run is None:
        return None
    rid, uri, ran = run.get("run_id"), run.get("tracking_uri"), run.get("ran")
    return RunRecord(
        run_id=str(rid) if rid else None,
        experiment_id=str(run.get("experiment_id") or ""),
        tracking_uri=str(uri) if uri else None,
        ran=ran if isinstance(ran, dict) else {},
    )


def read_dvc_lock(path: Path) -> list[LockRow] | None:
    """The outputs recorded in ``dvc.lock``, in file order.

    Returns:
        The rows (md5 "not available" when an output has none), or None when the file is
        missing or not a DVC lock file.
    """
    import yaml

    try:
        lock = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, yaml.YAMLError) as e:
        log.warning("report: cannot read %s (%s)", path, e)
        return None
    stages = lock.get("stages") if isinstance(lock, dict) else None
    if not isinstance(stages, dict):
        return None
    rows = []
    for stage, entry in stages.items():
        for out in (entry or {}).get("outs") or []:
            if isinstance(out, dict) and "path" in out:
                md5 = str(out.get("md5", "not available"))
                rows.append(LockRow(str(stage), str(out["path"]), md5))
    return rows


def load_features(path: Path) -> Embeddings | None:
    """A features file written by the embed stage, or None when missing.

    The (N, D) features are memory-mapped (``torch.load(mmap=True)``): the page cache holds
    them, not the report's own memory (8 GB of 2,048-d features at a million images).
    """
    import torch

    path = Path(path)
    if not path.is_file():
        return None
    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return Embeddings(features=obj["features"], labels=obj["labels"], keys=list(obj["keys"]))


def _shard_paths(shard_dir: Path) -> list[Path]:
    """The shards of one split: in manifest order when there is a manifest, else sorted."""
    try:
        manifest = read_manifest(shard_dir)
    except ShardError:  # none, or unreadable: the files themselves
        return sorted(shard_dir.glob("*.tar"))
    return [shard_dir / s.name for s in manifest.shards if s.name is not None]


def load_shard_images(shard_dir: Path, keys: Iterable[str]) -> dict[str, Any]:
    """Decode the image members of the requested keys from a split's tar shards.

    Only image members (:data:`pipeline.data.external.IMAGE_MEMBERS`) are decoded (with PIL,
    upright: :func:`pipeline.data.external.open_image`); nothing is unpickled. Reading stops
    as soon as every key is found.

    Args:
        shard_dir: a split directory (``data/shards/test``) holding ``*.tar`` shards.
        keys: the sample keys wanted.

    Returns:
        key -> PIL image (mode ``L`` or ``RGB``) for the keys found; missing keys are absent.
    """
    wanted: set[str] = set(keys)
    found: dict[str, Any] = {}
    for shard in _shard_paths(Path(shard_dir)):
        if len(found) == len(wanted):
            break
        found.update(shard_images(shard, wanted - set(found)))
    return found


def shard_images(shard: Path, wanted: set[str]) -> dict[str, Any]:
    """The decoded images of the wanted keys in one local tar shard, by key.

    A sample's key and extension are split as every reader splits them
    (:func:`pipeline.data.shards.member_key`), so shards read in place (img2dataset layout)
    work too. A missing file or a member that does not decode gives no entry.

    Args:
        shard: the tar file.
        wanted: the sample keys wanted.

    Returns:
        key -> PIL image (mode ``L`` or ``RGB``).
    """
    found: dict[str, Any] = {}
    if not wanted or not Path(shard).is_file():
        return found
    with tarfile.open(shard, "r") as tar:
        for member in tar:
            key, ext = member_key(member.name)
            if not member.isfile() or (ext or "").lower() not in IMAGE_MEMBERS or key not in wanted:
                continue
            try:
                image = open_image(tar.extractfile(member).read())  # type: ignore[union-attr]
            except (OSError, SyntaxError) as e:  # PIL's UnidentifiedImageError is an OSError
                log.warning("report: %s: sample %r does not decode (%s)", shard, key, e)
                continue
            found[key] = image if image.mode in ("L", "RGB") else image.convert("RGB")
            if len(found) == len(wanted):
                break
    return found


def read_data_insights(path: Path) -> dict[str, Any] | None:
    """``eval/data_insights.json`` when it has the fields the report shows, else None.

    Needed: ``images``, ``duplicate_pairs``, ``duplicate_cosine``, ``k``, ``pairs`` (each with
    a ``cosine`` and ``a`` / ``b`` holding ``key`` and ``shard``) and ``outliers`` (each with
    ``key``, ``shard`` and ``score``).
    """
    data = read_json(path)
    try:
        ok = (all(_finite(data[f]) for f in ("images", "duplicate_pairs", "duplicate_cosine", "k"))
              and all(_finite(p["cosine"]) and all(isinstance(p[s][f], str) for s in "ab"
                                                   for f in ("key", "shard"))
                      for p in data["pairs"])
              and all(_finite(o["score"]) and isinstance(o["key"], str)
                      and isinstance(o["shard"], str) for o in data["outliers"]))
    except (TypeError, KeyError):
        ok = False
    return _if_whole(path, data, ok, "a data-insights file")


def collect_final_metrics(root: Path) -> dict[str, float]:
    """The union of all stages' final metrics, named ``<stage>.<metric>``.

    Reads the metrics files of :data:`METRICS_FILES` that exist; nested objects flatten with
    dots; only numbers are kept (booleans and strings are dropped).

    Args:
        root: the repo root the metrics paths are relative to.

    Returns:
        e.g. ``{"pretrain.loss": 5.1, "knn.top1": 71.2, "baselines.raw_pixels_top1": 80.1}``,
        sorted by name.
    """
    out: dict[str, float] = {}

    def add(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                add(f"{prefix}.{k}", v)
        elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
            out[prefix] = float(obj)

    for prefix, rel in METRICS_FILES.items():
        add(prefix, read_json(Path(root) / rel) or {})
    return dict(sorted(out.items()))
