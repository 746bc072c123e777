"""The ``label_efficiency`` stage: top-1 from 1, 2, 5, ... labelled images per class.

Three feature kinds on the same draws (:mod:`pipeline.evaluate.label_efficiency`): the MoCo
features of the ``embed`` stage (``features/{train,test}.pt``: ``embed.layer`` and
``embed.pool_grid``), raw pixels, and the random-init encoder of the ``baselines`` stage (the
same weights: :func:`pipeline.evaluate.run.baselines.random_encoder`). Raw pixels and the random
encoder need images: the test split whole, and of the train split only the drawn rows (one pass
that decodes every train image but keeps only those).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import PERCENT_DECIMALS, write_metrics, write_tsv
from pipeline.config import LinearParams, ModelParams
from pipeline.data.eval_loader import eval_loader
from pipeline.data.remote import ShardURL
from pipeline.data.shards import image_spec, read_manifest
from pipeline.data.views import build_eval_transform
from pipeline.errors import InputError
from pipeline.evaluate.features import extract_features, load_features, pick_device
from pipeline.evaluate.label_efficiency import curve, draw_per_class
from pipeline.evaluate.run.baselines import Flatten, random_encoder

log = logging.getLogger(__name__)

KINDS = ("moco", "raw_pixels", "random_encoder")
# the points of the curve in metrics/label_efficiency.json, when measured: MoCo's mean top-1
# with 1 and with 10 labelled images per class (the whole curve: plots/ and eval/metrics/)
HEADLINE_PER_CLASS = (1, 10)
PLOT_COLUMNS = ("per_class", "features", "probe", "top1", "top1_min", "top1_max", "labels")


def _drawn_images(split: Path | ShardURL, rows: set[int], transform: Any, batch_size: int,
                  keys: list[str]) -> tuple[torch.Tensor, list[int]]:
    """The evaluation-transformed images of ``rows`` (manifest order) of a split, stacked.

    Raises:
        ValueError: the split's keys differ from ``keys`` (features of other shards).
    """
    images, order, at = [], [], 0
    for x, _, k in eval_loader(split, transform=transform, batch_size=batch_size):
        for j, key in enumerate(k):
            if keys[at + j] != key:
                raise InputError(f"{split}: sample {at + j} is '{key}', the features hold "
                                 f"'{keys[at + j]}' (features/train.pt is of other shards: "
                                 "rerun embed)")
            if at + j in rows:
                images.append(x[j])
                order.append(at + j)
        at += len(k)
    return torch.stack(images), order


def label_efficiency(*, features_dir: Path, shards_dir: Path | ShardURL, model: ModelParams,
                     seed: int, linear: LinearParams, per_class: list[int], draws: int,
                     layer: int, pool_grid: int, batch_size: int = 512) -> dict[str, Any]:
    """The curve of the three feature kinds (written by :func:`write_label_efficiency`).

    Returns:
        ``{"draws": D, "train_images": N, "curve": {kind: {probe:
        {str(n): {"mean", "std", "min", "max"}}}}, "wall_time_s": s}``, top-1 in percent.
    """
    t0 = time.time()
    device = pick_device()
    train, test = (load_features(features_dir / f"{s}.pt") for s in ("train", "test"))
    manifest = read_manifest(shards_dir / "train")
    spec = image_spec(manifest, shards_dir / "train")
    num_classes = len(manifest.class_names)
    rows = {i for n in per_class for d in range(draws)
            for i in draw_per_class(train.labels, n, seed=seed, draw=d)}
    tf = build_eval_transform(spec.size, spec.mean, spec.std)
    images, order = _drawn_images(shards_dir / "train", rows, tf, batch_size, train.keys)
    nets = {"raw_pixels": Flatten(), "random_encoder": random_encoder(
        model, seed=seed, image_size=spec.size, in_channels=spec.channels, layer=layer,
        pool_grid=pool_grid).to(device)}
    drawn = {"moco": train.subset(order)}
    tests = {"moco": test}
    for kind, net in nets.items():
        batches = ((images[i:i + batch_size], train.labels[order[i:i + batch_size]],
                    [train.keys[j] for j in order[i:i + batch_size]])
                   for i in range(0, len(order), batch_size))
        drawn[kind] = extract_features(net, batches, device=device, progress=False)
        tests[kind] = extract_features(net, eval_loader(shards_dir / "test", transform=tf,
                                                        batch_size=batch_size),
                                       device=device, desc=f"{kind} test")
    position = {row: i for i, row in enumerate(order)}

    def features_of(kind: str):  # noqa: ANN202 - a closure over one kind
        return lambda idx: drawn[kind].subset([position[i] for i in idx])

    result = curve({kind: features_of(kind) for kind in KINDS}, tests, train.labels,
                   per_class=per_class, draws=draws, seed=seed, num_classes=num_classes,
                   linear=linear, device=device)
    log.info("label efficiency: %d drawn train images, %.1fs", len(order), time.time() - t0)
    return {"draws": draws, "train_images": len(train),
            "curve": result, "wall_time_s": round(time.time() - t0, 1)}



def headline(result: dict[str, Any]) -> dict[str, Any]:
    """``metrics/label_efficiency.json``: MoCo's mean top-1 at :data:`HEADLINE_PER_CLASS`.

    Args:
        result: :func:`label_efficiency`'s dict.

    Returns:
        ``{"knn": {"1": %, "10": %}, "linear": {...}, "wall_time_s": s}`` (top-1 to 0.01 pt,
        as every accuracy of metrics/: :func:`pipeline.atomic.round_metric`); ``dvc metrics show``
        names them ``knn.1``, ``knn.10``, ... (the only counts, so they sort as numbers); a count
        that ``label_efficiency.per_class`` leaves out is absent.
    """
    moco = result["curve"]["moco"]
    return {**{probe: {str(n): round(points[str(n)]["mean"], PERCENT_DECIMALS)
                       for n in HEADLINE_PER_CLASS
                       if str(n) in points} for probe, points in moco.items()},
            "wall_time_s": result["wall_time_s"]}


def plot_rows(curve: dict[str, Any]) -> list[dict[str, Any]]:
    """The curve as rows of ``plots/label_efficiency.tsv`` (:data:`PLOT_COLUMNS`).

    One row per (labels per class, feature kind, probe), in increasing ``per_class``: the mean
    top-1 over the draws (%) and its min and max (``.dvc/plots/label_efficiency.json`` draws the
    mean as a line, min-max as a bar), and the labelled images the point used in all (fewer
    than per_class x classes where a class holds fewer).
    """
    rows = [{"per_class": int(n), "features": kind, "probe": probe, "top1": pt["mean"],
             "top1_min": pt["min"], "top1_max": pt["max"], "labels": pt["labels"]}
            for kind, probes in curve.items() for probe, points in probes.items()
            for n, pt in points.items()]
    return sorted(rows, key=lambda r: r["per_class"])


def write_label_efficiency(result: dict[str, Any], *, metrics_path: Path, details_path: Path,
                           plots_path: Path) -> None:
    """The stage's three outputs, each atomically.

    Args:
        result: :func:`label_efficiency`'s dict.
        metrics_path: ``metrics/label_efficiency.json`` (:func:`headline`).
        details_path: ``eval/metrics/label_efficiency.json``: ``result`` whole (mean, std, min,
            max of every point).
        plots_path: ``plots/label_efficiency.tsv`` (:func:`plot_rows`).
    """
    write_metrics(details_path, result)
    write_tsv(plots_path, PLOT_COLUMNS, plot_rows(result["curve"]))
    write_metrics(metrics_path, headline(result))
