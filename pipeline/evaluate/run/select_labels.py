"""The ``select_labels`` stage: which pretraining images to label, and how well they would do.

Picks (:mod:`pipeline.evaluate.selection`, no labels read) come from ``features/insights.pt``,
the global features, outlier scores and near-duplicate pairs ``data_insights`` computed for
every pretraining image. For every budget of ``selection.budget`` and every method of
``selection.compare`` (plus ``selection.method``) the picks go to ``eval/selection.json``; those
of ``selection.method`` to ``selection/labels_to_collect.csv``, the file for an annotator.

The measurement is what a user with an oracle would see: when the pretraining images are the
labelled train split (the default run), the picked images' true labels are taken from
``features/train.pt`` (``embed``'s features, the ones ``label_efficiency`` uses), and both probes
are fitted on the picks exactly as :mod:`pipeline.evaluate.label_efficiency` fits them, then
scored on the whole test set. ``random`` is drawn ``selection.draws`` times (mean and spread).
Otherwise (no labels, or other images) the picks are written and the measurement is skipped,
saying why.
"""

from __future__ import annotations

import csv
import io
import logging
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import PERCENT_DECIMALS, write_atomic, write_json, write_metrics, write_tsv
from pipeline.config import LinearParams, SelectionParams
from pipeline.data.remote import ShardURL
from pipeline.data.shards import missing_labels
from pipeline.evaluate import selection as sel
from pipeline.evaluate.features import FeatureSet, load_features, pick_device
from pipeline.evaluate.insights import load_neighbourhoods
from pipeline.evaluate.label_efficiency import PROBES, probe_top1, summary

log = logging.getLogger(__name__)

# metrics/selection.json: selection.method's top-1 from this many labels (when in the budget);
# two numbers, so `dvc metrics show` stays one screen wide (tests/test_dvc_metrics.py)
HEADLINE_BUDGET = 20
PLOT_COLUMNS = ("budget", "method", "probe", "top1", "top1_min", "top1_max", "classes")
CSV_COLUMNS = ("budget", "order", "key", "shard", "cluster")
SCORE_DECIMALS = 6


def _methods(p: SelectionParams) -> list[str]:
    """``selection.compare`` then ``selection.method`` when not among them, as strings."""
    names = [str(m) for m in p.compare]
    return names + ([str(p.method)] if str(p.method) not in names else [])


def pick_all(data: dict[str, Any], p: SelectionParams, *, seed: int
             ) -> tuple[dict[str, dict[int, list[list[int]]]], dict[str, Any]]:
    """Every method's picks at every budget (random: ``p.draws`` draws), and their details.

    Returns:
        ``(picks, info)``: ``picks[method][budget]`` is a list of draws (one for a method
        without draws), each the picked rows in pick order; ``info`` holds the clusters of
        ``typical`` (``info["clusters"][budget]``), ProbCover's radius, the excluded images and
        each method's seconds.
    """
    x = sel.unit_rows(data["features"])
    n = len(x)
    sel.check_budgets(p.budget, n)
    eligible = sel.eligible_mask(n, outlier_score=data["outlier_score"],
                                 exclude_outliers=p.exclude_outliers)
    sel.check_budgets(p.budget, int(eligible.sum()), what=(
        f"images left to pick from: {n} pretraining images less the most isolated "
        f"(selection.exclude_outliers {p.exclude_outliers:g}, ties at the cut included)"))
    pairs = data["pairs"]
    top = max(p.budget)
    picks: dict[str, dict[int, list[list[int]]]] = {}
    info: dict[str, Any] = {"excluded_outliers": int(n - eligible.sum()), "seconds": {},
                            "clusters": {}, "short": {}}
    for method in _methods(p):
        t0 = time.time()
        if method == "random":
            draws = [sel.pick_random(n, top, seed=seed, draw=d) for d in range(p.draws)]
            picks[method] = {b: [d[:b] for d in draws] for b in p.budget}
        elif method == "kcenter":
            order = sel.pick_kcenter(x, top, eligible=eligible, pairs=pairs)
            picks[method] = {b: [order[:b]] for b in p.budget}
        elif method == "probcover":
            delta = sel.probcover_delta(x, clusters=min(p.budget), seed=seed)
            info["probcover_delta"] = round(delta, SCORE_DECIMALS)
            order = sel.pick_probcover(x, top, eligible=eligible, delta=delta, seed=seed,
                                       pairs=pairs)
            picks[method] = {b: [order[:b]] for b in p.budget}
        else:  # typical: one clustering per budget
            picks[method] = {}
            for b in p.budget:
                rows, clusters = sel.pick_typical(x, b, eligible=eligible, seed=seed,
                                                  pairs=pairs)
                picks[method][b] = [rows]
                info["clusters"][b] = clusters
        for b, draws in picks[method].items():  # near-duplicates can leave too few images
            if len(draws[0]) < b:
                info["short"].setdefault(method, {})[str(b)] = len(draws[0])
                log.warning("select_labels: %s picked %d images of a budget of %d: the rest "
                            "are near-duplicates of its picks or excluded outliers", method,
                            len(draws[0]), b)
        info["seconds"][method] = round(time.time() - t0, 1)
        log.info("select_labels: %s picked in %.1fs", method, time.time() - t0)
    return picks, info


def measurable(shards_dir: Path | ShardURL, data: dict[str, Any]) -> str | None:
    """Why the picks cannot be scored with true labels, or None when they can.

    They can when the train and test splits hold labelled images and the pretraining set is
    exactly the built ``pretrain`` split and that split is the ``train`` split's shards (as
    ``data_insights`` found: ``built_is_train``).
    """
    why = missing_labels(shards_dir)
    if why is not None:
        return why
    if data["built"] != len(data["keys"]):
        return "the pretraining images include data.pretrain_shards, which carry no labels here"
    if not data["built_is_train"]:
        return ("the pretraining images are not the labelled train split's (e.g. "
                "data.max_pretrain_images differs from data.max_train_images): no true labels "
                "for the picks")
    return None


def measure(picks: dict[str, dict[int, list[list[int]]]], keys: list[str], train: FeatureSet,
            test: FeatureSet, *, linear: LinearParams, seed: int,
            device: torch.device) -> dict[str, Any]:
    """Both probes' top-1 (%) and the classes reached, per method and budget, over the draws.

    Args:
        picks: :func:`pick_all`'s picks (rows of the pretraining set).
        keys: the pretraining set's keys (row -> key).
        train: ``features/train.pt`` (the labels are the oracle's).
        test: ``features/test.pt``.
        linear: the linear probe's params.
        seed: ``seed`` (draw ``d`` fits with ``seed + d``, as label_efficiency does).
        device: where the probes run.

    Returns:
        ``{method: {str(budget): {"knn": summary, "linear": summary, "classes": summary}}}``,
        summaries ``{"mean", "min", "max", "std"}`` over the draws.

    Raises:
        InputError: a picked key absent from ``features/train.pt``.
    """
    from pipeline.errors import InputError

    row_of = {k: i for i, k in enumerate(train.keys)}
    num_classes = int(max(train.labels.max(), test.labels.max())) + 1
    out: dict[str, Any] = {}
    for method, by_budget in picks.items():
        out[method] = {}
        for b, draws in by_budget.items():
            scores: dict[str, list[float]] = {probe: [] for probe in (*PROBES, "classes")}
            for d, rows in enumerate(draws):
                try:
                    fs = train.subset([row_of[keys[r]] for r in rows])
                except KeyError as e:
                    raise InputError(f"select_labels: picked image {e} is not in "
                                     "features/train.pt: rerun embed") from None
                scores["classes"].append(float(len(set(fs.labels.tolist()))))
                for probe in PROBES:
                    scores[probe].append(probe_top1(
                        fs, test, probe=probe, num_classes=num_classes, linear=linear,
                        seed=seed + d, device=device))
            out[method][str(b)] = {name: summary(v) for name, v in scores.items()}
        log.info("select_labels: %s: %s", method, ", ".join(
            f"{b} labels kNN {v['knn']['mean']:.2f} linear {v['linear']['mean']:.2f}"
            for b, v in out[method].items()))
    return out


def _csv(rows: list[dict[str, Any]]) -> bytes:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue().encode()


def details(picks: dict[str, dict[int, list[list[int]]]], info: dict[str, Any],
            data: dict[str, Any], p: SelectionParams) -> dict[str, Any]:
    """``eval/selection.json``: every method's first draw of picks per budget, with keys."""
    keys, where = data["keys"], data["where"]
    score = data["outlier_score"]

    def image(rows: list[int], b: int, method: str) -> list[dict[str, Any]]:
        clusters = info["clusters"].get(b) if method == "typical" else None
        return [{"order": i + 1, "key": keys[r], "shard": where[r], "row": r,
                 "cluster": clusters[i] if clusters else None,
                 "outlier_score": round(float(score[r]), 3)} for i, r in enumerate(rows)]

    return {"method": str(p.method), "budgets": list(p.budget), "images": len(keys),
            "excluded_outliers": info["excluded_outliers"],
            "probcover_delta": info.get("probcover_delta"),
            "short_of_budget": info["short"], "seconds": info["seconds"],
            "picks": {m: {str(b): image(draws[0], b, m) for b, draws in by.items()}
                      for m, by in picks.items()}}


def select_labels(*, neighbourhoods_path: Path, features_dir: Path,
                  shards_dir: Path | ShardURL, selection: SelectionParams,
                  linear: LinearParams, seed: int) -> dict[str, Any]:
    """Pick, and measure where labels allow (module docstring).

    Returns:
        ``{"images", "picks", "info", "measured": {...} or None, "skipped": why or None,
        "wall_time_s"}``.

    Raises:
        FileNotFoundError: ``features/insights.pt`` is missing.
        InputError: a budget above the pretraining images, or a stale feature file.
    """
    t0 = time.time()
    data = load_neighbourhoods(neighbourhoods_path)
    picks, info = pick_all(data, selection, seed=seed)
    why = measurable(shards_dir, data)
    measured = None
    if why is None:
        train, test = (load_features(features_dir / f"{s}.pt") for s in ("train", "test"))
        measured = measure(picks, data["keys"], train, test, linear=linear, seed=seed,
                           device=pick_device())
    else:
        log.warning("select_labels: picks written, not measured: %s", why)
    return {"images": len(data["keys"]), "data": data, "picks": picks, "info": info,
            "measured": measured, "skipped": why, "wall_time_s": round(time.time() - t0, 1)}


def headline(result: dict[str, Any], p: SelectionParams) -> dict[str, Any]:
    """``metrics/selection.json``: ``selection.method``'s top-1 at :data:`HEADLINE_BUDGET`.

    ``{"at_20": {"knn": %, "linear": %}, "wall_time_s": s}`` (``dvc metrics show`` columns
    ``at_20.knn``, ``at_20.linear``; random's and every other point: ``eval/metrics/``); only
    the time when nothing was measured or the budget is not in ``selection.budget``.
    """
    point = (result["measured"] or {}).get(str(p.method), {}).get(str(HEADLINE_BUDGET))
    out = {} if point is None else {f"at_{HEADLINE_BUDGET}": {
        probe: round(point[probe]["mean"], PERCENT_DECIMALS) for probe in PROBES}}
    return {**out, "wall_time_s": result["wall_time_s"]}


def plot_rows(measured: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``plots/selection.tsv`` rows (:data:`PLOT_COLUMNS`): one per (budget, method, probe)."""
    rows = [{"budget": int(b), "method": m, "probe": probe, "top1": v[probe]["mean"],
             "top1_min": v[probe]["min"], "top1_max": v[probe]["max"],
             "classes": v["classes"]["mean"]}
            for m, by in (measured or {}).items() for b, v in by.items() for probe in PROBES]
    return sorted(rows, key=lambda r: r["budget"])


def write_selection(result: dict[str, Any], p: SelectionParams, *, details_path: Path,
                    csv_path: Path, metrics_path: Path, all_metrics_path: Path,
                    plots_path: Path) -> None:
    """The stage's outputs, each atomically.

    Args:
        result: :func:`select_labels`' dict.
        p: the ``selection`` params.
        details_path: ``eval/selection.json`` (:func:`details`).
        csv_path: ``selection/labels_to_collect.csv``: ``selection.method``'s picks, one row
            per (budget, order), with the key and shard of each image and its cluster
            (``typical``).
        metrics_path: ``metrics/selection.json`` (:func:`headline`).
        all_metrics_path: ``eval/metrics/selection.json``: every measured point, the seconds,
            or why nothing was measured.
        plots_path: ``plots/selection.tsv`` (:func:`plot_rows`; no rows when not measured).
    """
    d = details(result["picks"], result["info"], result["data"], p)
    write_json(details_path, d)
    rows = [{"budget": b, "order": img["order"], "key": img["key"], "shard": img["shard"],
             "cluster": "" if img["cluster"] is None else img["cluster"]}
            for b, imgs in d["picks"][str(p.method)].items() for img in imgs]
    write_atomic(csv_path, lambda f: f.write(_csv(rows)))
    write_metrics(all_metrics_path, {
        "images": result["images"], "excluded_outliers": d["excluded_outliers"],
        "draws": p.draws, "measured": result["measured"], "skipped": result["skipped"],
        "short_of_budget": d["short_of_budget"],
        "seconds": d["seconds"], "wall_time_s": result["wall_time_s"]})
    write_tsv(plots_path, PLOT_COLUMNS, plot_rows(result["measured"]))
    write_metrics(metrics_path, headline(result, p))
