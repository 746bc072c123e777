"""Curves as run artifacts: the table and a figure of it, in the MLflow run that made them.

A curve's table is a TSV with a header row (the ``plots/*.tsv`` file DVC tracks, or one written
for the run); :func:`log_curve` logs it as ``curves/<name>.tsv`` (MLflow's artifact view shows a
TSV as a table) and beside it ``curves/<name>.png``, drawn from the same table with matplotlib:
one panel per unit, one line per column, a column ``<y>_std`` drawn as a band around ``<y>``,
and a column with no number in it (``val_acc`` without a validation split) not drawn at all.

:data:`STAGE_CURVES` lists them; :func:`~pipeline.tracking.stage_run` logs a stage's curves
when its block completes (:func:`log_stage_curves`), so the stage scripts do not change:

* pretrain: ``knn_monitor`` (``plots/knn_monitor.tsv``) and ``labelfree``
  (``plots/labelfree.tsv``), per epoch.
* label_efficiency: ``label_efficiency``, top-1 against labelled images per class, MoCo beside
  raw pixels and the random encoder (the ``curve`` of ``eval/metrics/label_efficiency.json``,
  :func:`label_efficiency_table`).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.atomic import read_json

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from pipeline.tracking.runs import StageRun

ARTIFACT_DIR = "curves"
DPI = 100


def read_table(path: Path) -> str | None:
    """A TSV's text, None when the file is missing."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class Curve:
    """One table of a stage and how to draw it.

    Attributes:
        name: the artifacts' stem (``curves/<name>.tsv``, ``curves/<name>.png``).
        source: the stage's output it comes from, relative to the repo root.
        title: the figure's title.
        x: the x column.
        panels: ``(panel title, columns)`` per panel, side by side; a column absent from the
            table is skipped.
        log_x: a logarithmic x axis.
        reader: ``source`` -> the table as TSV text (None: the stage wrote none); default: the
            file's text (``source`` is a TSV).
    """

    name: str
    source: str
    title: str
    x: str
    panels: tuple[tuple[str, tuple[str, ...]], ...]
    log_x: bool = False
    reader: Callable[[Path], str | None] = read_table


LABEL_EFFICIENCY_X = "labels_per_class"


def label_efficiency_table(curve: Mapping[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The label-efficiency curve as one row per labels-per-class count.

    Args:
        curve: ``{features: {probe: {n: {"mean", "std", ...}}}}`` (the label_efficiency
            stage's ``curve``; features ``moco``, ``raw_pixels``, ``random_encoder``, ...).

    Returns:
        ``(columns, rows)``: ``labels_per_class`` then ``<features>_<probe>`` (mean top-1, %)
        and ``<features>_<probe>_std`` for each; rows in increasing ``labels_per_class``.
    """
    pairs = [(f, p) for f, probes in curve.items() for p in probes]
    counts = sorted({int(n) for f, p in pairs for n in curve[f][p]})
    columns = [LABEL_EFFICIENCY_X] + [c for f, p in pairs for c in (f"{f}_{p}", f"{f}_{p}_std")]
    rows = []
    for n in counts:
        row: dict[str, Any] = {LABEL_EFFICIENCY_X: n}
        for f, p in pairs:
            point = curve[f][p].get(str(n))
            if point is not None:
                row[f"{f}_{p}"], row[f"{f}_{p}_std"] = point.get("mean"), point.get("std")
        rows.append(row)
    return columns, rows


def _label_efficiency_tsv(path: Path) -> str | None:
    """The table of ``eval/metrics/label_efficiency.json``'s ``curve`` as TSV text (None: none)."""
    import pandas as pd

    curve = (read_json(path) or {}).get("curve")
    if not isinstance(curve, dict) or not curve:
        return None
    columns, rows = label_efficiency_table(curve)
    return pd.DataFrame(rows, columns=columns).to_csv(sep="\t", index=False)


_MOCO_AND_BASELINES = tuple(f"{f}_{p}" for f in ("moco", "raw_pixels", "random_encoder")
                            for p in ("knn", "linear"))


# stage -> its curves, logged by stage_run when the stage's block completes
STAGE_CURVES: dict[str, tuple[Curve, ...]] = {
    "pretrain": (
        Curve("knn_monitor", "plots/knn_monitor.tsv",
              "kNN monitor during pretraining (held-out images)", "epoch",
              (("top-1 (%)", ("knn_top1",)), ("top-5 (%)", ("knn_top5",)))),
        Curve("labelfree", "plots/labelfree.tsv",
              "Label-free quality of the features during pretraining", "epoch",
              (("effective rank (RankMe; higher = more dimensions used)", ("rankme",)),
               ("alignment of two views (lower = closer)", ("alignment",)),
               ("uniformity (lower = more spread)", ("uniformity",)))),
    ),
    "label_efficiency": (
        Curve("label_efficiency", "eval/metrics/label_efficiency.json",
              "Top-1 from a few labelled images per class", LABEL_EFFICIENCY_X,
              (("top-1 (%), mean and std over draws", _MOCO_AND_BASELINES),), log_x=True,
              reader=_label_efficiency_tsv),
    ),
}


def draw_curve(table: Any, curve: Curve) -> Figure:
    """The figure of ``table`` (a pandas DataFrame with the curve's columns).

    Columns absent from the table or without a finite value are not drawn; a panel with none
    left says so in its middle.
    """
    import numpy as np
    from matplotlib.figure import Figure  # lazy: no matplotlib work at import time
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    fig = Figure(figsize=(max(6.4, 4.6 * len(curve.panels)), 3.8), dpi=DPI,
                 layout="constrained")
    axes = fig.subplots(1, len(curve.panels), squeeze=False)[0]
    x = table[curve.x].to_numpy(dtype=float)
    for ax, (title, columns) in zip(axes, curve.panels):
        drawn = 0
        for c in columns:
            y = table[c].to_numpy(dtype=float) if c in table else np.full_like(x, np.nan)
            ok = np.isfinite(x) & np.isfinite(y)
            if not ok.any():
                continue
            (line,) = ax.plot(x[ok], y[ok], marker="o", markersize=3, label=c)
            if f"{c}_std" in table:
                s = table[f"{c}_std"].to_numpy(dtype=float)[ok]
                ax.fill_between(x[ok], y[ok] - s, y[ok] + s, color=line.get_color(), alpha=0.15,
                                linewidth=0)
            drawn += 1
        if curve.log_x:  # ticks at the measured x values, written as numbers (1, 10, 100)
            ax.set_xscale("log")
            ax.set_xticks(np.unique(x[np.isfinite(x)]), minor=False)
            ax.set_xticks([], minor=True)
            ax.xaxis.set_major_formatter(ScalarFormatter())
        else:  # epochs, counts: whole numbers
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(curve.x)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if drawn > 1:
            ax.legend(fontsize=8)
        elif drawn == 0:
            ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(curve.title)
    return fig


def log_curve(run: StageRun, curve: Curve, root: Path | None = None) -> bool:
    """Log a curve's table and figure as ``curves/<name>.tsv`` and ``curves/<name>.png``.

    Nothing is logged for an inactive run or a missing or empty table (a stage that measured
    no such curve, e.g. no labelled images for the kNN monitor).

    Args:
        run: the stage's run.
        curve: which table, how to draw it.
        root: the repo root ``curve.source`` is relative to (default: the current directory).

    Returns:
        Whether it was logged.
    """
    text = curve.reader((Path.cwd() if root is None else Path(root)) / curve.source)
    if not run.active or text is None:
        return False
    import mlflow
    import pandas as pd

    table = pd.read_csv(io.StringIO(text), sep="\t")
    if table.empty:  # a header and no row: nothing was measured
        return False
    mlflow.log_text(text, f"{ARTIFACT_DIR}/{curve.name}.tsv")
    mlflow.log_figure(draw_curve(table, curve), f"{ARTIFACT_DIR}/{curve.name}.png")
    return True


def log_stage_curves(run: StageRun, stage: str, root: Path | None = None) -> list[str]:
    """:func:`log_curve` of each of the stage's :data:`STAGE_CURVES`; the names logged."""
    return [c.name for c in STAGE_CURVES.get(stage, ()) if log_curve(run, c, root)]
