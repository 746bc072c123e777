"""The report's "Which images to label": the picks and, with labels, what they would give.

Reads ``eval/metrics/selection.json`` (every measured point) and ``eval/selection.json`` (the
picks) of the ``select_labels`` stage (:mod:`pipeline.evaluate.run.select_labels`): a figure of
top-1 against the labelling budget, one line per method (random: mean and min-max over its
draws), a table with the classes each budget reaches, one sentence comparing the best method
with random at the smallest budgets, and thumbnails of ``selection.method``'s first picks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.atomic import read_json
from pipeline.report import figures as fg
from pipeline.report.document import NOT_AVAILABLE, FigureRef, Paragraph, Section, Table
from pipeline.report.insights import load_images

TITLE = "Which images to label"
NAMES = {"random": "random", "kcenter": "k-center coreset", "typical": "TypiClust (typical)",
         "probcover": "ProbCover"}
PER_ROW = 6
MARGIN_POINTS = 5.0  # a method "beats random" when its mean is this many points above (issue #55)


def _by_budget(per_budget: Mapping[str, Any]) -> dict[str, Any]:
    """``{str(budget): ...}`` in increasing budget (the JSON files sort keys as text)."""
    return {b: per_budget[b] for b in sorted(per_budget, key=int)}


def read_selection(root: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(eval/metrics/selection.json, eval/selection.json)``, each None when missing.

    Every ``{budget: ...}`` mapping in increasing budget.
    """
    allm, picks = (read_json(root / "eval/metrics/selection.json"),
                   read_json(root / "eval/selection.json"))
    if allm and allm.get("measured"):  # random, the baseline, first
        allm["measured"] = {m: _by_budget(v) for m, v in sorted(
            allm["measured"].items(), key=lambda mv: (mv[0] != "random", mv[0]))}
    if picks and picks.get("picks"):
        picks["picks"] = {m: _by_budget(v) for m, v in picks["picks"].items()}
    return allm, picks


def plot_selection(measured: Mapping[str, Any], path: Path) -> Path:
    """Top-1 against the budget (log x), one line per method, one panel per probe."""
    fig, axes = fg._figure(10.5, 3.8, ncols=2)
    for ax, probe in zip(axes, ("knn", "linear")):
        ax.set_xscale("log")
        for i, (method, points) in enumerate(measured.items()):
            b = np.array([int(k) for k in points], dtype=float)
            mean = np.array([points[k][probe]["mean"] for k in points])
            lo = np.array([points[k][probe]["min"] for k in points])
            hi = np.array([points[k][probe]["max"] for k in points])
            ax.plot(b, mean, marker="o", color=f"C{i}", label=NAMES.get(method, method))
            if (hi > lo).any():
                ax.fill_between(b, lo, hi, color=f"C{i}", alpha=0.2)
        ax.set(xlabel="labelled images in all", ylabel="top-1 (%)",
               title="kNN" if probe == "knn" else "linear probe")
        ax.set_xticks(b, [str(int(v)) for v in b])
        ax.set_xticks([], minor=True)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    return fg._save(fig, path)


def plot_picks(items: list[Mapping[str, Any]], images: Mapping[tuple[str, str], Any],
               path: Path) -> Path:
    """The first picks in a grid, in pick order, each titled with its order and cluster."""
    rows = math.ceil(len(items) / PER_ROW)
    fig, axes = fg._figure(1.7 * PER_ROW, 2.0 * rows, ncols=PER_ROW, nrows=rows)
    for ax in axes[len(items):]:
        ax.axis("off")
    for item, ax in zip(items, axes):
        fg._show_image(ax, images.get((item["shard"], item["key"])))
        cluster = "" if item.get("cluster") is None else f"  cluster {item['cluster']}"
        ax.set_title(f"#{item['order']}{cluster}", fontsize=7)
        ax.set_xlabel(str(item["key"])[-18:], fontsize=7)
    return fg._save(fig, path)


def verdict(measured: Mapping[str, Any]) -> str:
    """The best method against random at the two smallest budgets and the largest, per probe.

    With the classes each reaches; said plainly when no method beats random.
    """
    if "random" not in measured or len(measured) < 2:
        return "No comparison with random: selection.compare holds no random or no other method."
    budgets = list(measured["random"])
    at = list(dict.fromkeys(budgets[:2] + budgets[-1:]))
    parts = []
    for b in at:
        r = measured["random"][b]
        for probe, name in (("knn", "kNN"), ("linear", "linear probe")):
            best = max((m for m in measured if m != "random"),
                       key=lambda m: measured[m][b][probe]["mean"])
            v = measured[best][b]
            d = v[probe]["mean"] - r[probe]["mean"]
            parts.append(f"{b} labels, {name}: {NAMES.get(best, best)} {v[probe]['mean']:.2f} % "
                         f"({v['classes']['mean']:.0f} classes) against random "
                         f"{r[probe]['mean']:.2f} % (draws {r[probe]['min']:.2f}-"
                         f"{r[probe]['max']:.2f}; {r['classes']['mean']:.1f} classes): "
                         f"{d:+.2f} points")
    gains = {(b, name): max(measured[m][b][p]["mean"] - measured["random"][b][p]["mean"]
                            for m in measured if m != "random")
             for b in budgets[:2] for p, name in (("knn", "kNN"), ("linear", "linear probe"))}
    ahead = [f"{b} labels {name}" for (b, name), g in gains.items() if g >= MARGIN_POINTS]
    if ahead:
        said = (f"A method beats random by at least {MARGIN_POINTS:g} points at "
                + ", ".join(ahead) + (f" (of {len(gains)} comparisons at the two smallest "
                                      "budgets)" if len(ahead) < len(gains) else ""))
    elif max(gains.values()) > 0:
        said = f"No method beats random by {MARGIN_POINTS:g} points at the smallest budgets"
    else:
        said = "No method beats random at the smallest budgets"
    return f"{said}. " + "; ".join(parts) + "."


def selection_section(root: Path, method: str, shown: int, fig_dir: Path) -> Section:
    """The picks, their measured worth when labels allowed, and the first picks' thumbnails.

    Args:
        root: the repo root (``eval/``, and the shards the thumbnails are read from).
        method: ``selection.method`` (the picks of the CSV).
        shown: thumbnails shown (``report.insight_images``).
        fig_dir: where ``selection.png`` and ``selection_picks.png`` are drawn.
    """
    sec = Section(TITLE)
    allm, picks = read_selection(root)
    if picks is None or allm is None:
        sec.blocks.append(Paragraph(f"Which images to label: {NOT_AVAILABLE} "
                                    "(eval/selection.json)."))
        return sec
    sec.blocks.append(Paragraph(
        f"selection/labels_to_collect.csv lists, for each budget of {picks['budgets']} "
        f"labels, the {NAMES.get(method, method)} picks among the {picks['images']} pretraining "
        "images, in pick order, with each image's key and shard: the file to hand to whoever "
        "labels. No label is read to pick them; the "
        f"{picks['excluded_outliers']} most isolated images (selection.exclude_outliers) are "
        "never picked (random ignores this), and a near-duplicate of a pick is not picked "
        "again."))
    short = picks.get("short_of_budget") or {}
    if short:
        sec.blocks.append(Paragraph("Fewer picks than the budget (the rest are near-duplicates "
                                    "of picks or excluded outliers): " + "; ".join(
                                        f"{NAMES.get(m, m)} {n} of {b}" for m, by in short.items()
                                        for b, n in by.items()) + "."))
    measured = allm.get("measured")
    if measured:
        plot_selection(measured, fig_dir / "selection.png")
        sec.blocks.append(FigureRef(
            "selection.png",
            "Top-1 on the whole test set from the picked images once labelled (their true "
            "labels: what a user with an annotator gets), both probes fitted as for the "
            f"label-efficiency curve; random: mean and min-max over {allm.get('draws')} seeded "
            "draws. In the table, ± is the standard deviation of random's draws."))
        budgets = list(next(iter(measured.values())))
        rows = [[NAMES.get(m, m), probe] + [
            f"{v[b][probe]['mean']:.2f}" + (f" ± {v[b][probe]['std']:.2f}"
                                            if v[b][probe]["std"] else "")
            for b in budgets] for m, v in measured.items() for probe in ("knn", "linear")]
        rows += [[NAMES.get(m, m), "classes reached"] + [f"{v[b]['classes']['mean']:.1f}"
                                                          for b in budgets]
                 for m, v in measured.items()]
        sec.blocks.append(Table(["picked by", "probe"] + [f"{b} labels" for b in budgets], rows))
        sec.blocks.append(Paragraph(verdict(measured)))
    else:
        sec.blocks.append(Paragraph(f"Not measured: {allm.get('skipped') or NOT_AVAILABLE}. "
                                    "The picks are written all the same."))
    first = _first_picks(picks, method, shown)
    if first:
        images = load_images(root, first)
        plot_picks(first, images, fig_dir / "selection_picks.png")
        sec.blocks.append(FigureRef(
            "selection_picks.png",
            f"The first {len(first)} picks of {NAMES.get(method, method)} at a budget of "
            f"{first[0]['budget']}, in pick order."))
    return sec


def _first_picks(picks: Mapping[str, Any], method: str, shown: int) -> list[dict[str, Any]]:
    """The first ``shown`` picks of ``method`` at the smallest budget holding that many."""
    by_budget = picks.get("picks", {}).get(method) or {}
    if not by_budget or shown <= 0:
        return []
    budget = next((b for b in by_budget if int(b) >= shown), list(by_budget)[-1])
    return [{**it, "budget": budget} for it in by_budget[budget][:shown]]
