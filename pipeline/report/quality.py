"""What the report says about quality without labels and with few: two sections, two figures.

* "Quality without labels": first the run's verdict (:func:`pipeline.report.labelfree_findings.
  report_sentence`), then RankMe, alignment, uniformity and view top-1 (:mod:`pipeline.evaluate.
  labelfree`) at the end of pretraining and per monitor epoch, each with one sentence on how to
  read it and what the project's studies found it answering (:data:`pipeline.report.
  labelfree_findings.ROLE`).
* "Label efficiency": kNN and linear-probe top-1 from a few labelled images per class
  (:mod:`pipeline.evaluate.label_efficiency`), MoCo beside raw pixels and the random encoder,
  with the pipeline's whole-train-set numbers as the last point, and the margin MoCo has over
  raw pixels at 10 labels per class, or the sentence saying it has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.evaluate.knn import DEFAULT_K, DEFAULT_T
from pipeline.evaluate.labelfree import METRICS
from pipeline.report import figures as fg
from pipeline.report.document import NOT_AVAILABLE, FigureRef, Paragraph, Section, Table, fmt
from pipeline.report.inputs import Metrics, RunOutputs
from pipeline.report.labelfree_findings import (
    ROLE,
    STUDY_FILE,
    VERDICTS_FILE,
    report_sentence,
    study_rho,
    within_run_rho,
)

READING = {
    "rankme": "RankMe is the effective number of feature directions the images use (at most "
              "the feature dimension D): an encoder that collapses drives it toward 1, and "
              "across self-supervised runs a higher one tends to go with higher accuracy "
              "(Garrido et al. 2023).",
    "alignment": "Alignment is the mean squared distance between the unit-length features of "
                 "two augmented views of one image (0 = identical, 4 = opposite): lower means "
                 "the encoder ignores the augmentations (Wang & Isola 2020).",
    "uniformity": "Uniformity is log mean exp(-2 x squared distance) over pairs of different "
                  "images on the unit sphere (0 = all on one point, down to about -4): lower "
                  "means the images spread more evenly (Wang & Isola 2020).",
    "view_top1": "View top-1 is the share of images whose other augmented view is their "
                 "nearest neighbour among the sample's views (chance = 1 / images; a constant "
                 "encoder gets it): how well the encoder tells images apart.",
}
LABELS = {"rankme": "RankMe (effective rank)", "alignment": "alignment",
          "uniformity": "uniformity", "view_top1": "view top-1 (%)"}
KIND_NAMES = {"moco": "MoCo", "raw_pixels": "raw pixels", "random_encoder": "random encoder"}
# the pipeline's whole-train-set numbers for each kind and probe: (metrics file, key)
ALL_LABELS = {
    ("moco", "knn"): ("knn", "top1"), ("moco", "linear"): ("linear", "top1"),
    ("raw_pixels", "knn"): ("baselines", "raw_pixels_knn_tuned_top1"),
    ("raw_pixels", "linear"): ("baselines", "raw_pixels_linear_top1"),
    ("random_encoder", "knn"): ("baselines", "random_encoder_top1"),
}
STAR_SIZE_PT = 11  # the all-labels stars' marker size (points)
STAR_GAP_PT = 13  # horizontal distance between the stars of one panel (points): > STAR_SIZE_PT
MARGIN_AT = "10"  # labels per class at which the report states MoCo's margin over raw pixels


def plot_labelfree(table: Mapping[str, np.ndarray], path: Path) -> Path:
    """The label-free numbers per monitor epoch (epoch 0 = random init), one panel each.

    A number the table lacks (a run older than it) gets no panel.
    """
    names = [k for k in METRICS if fg._has(table, k)]
    fig, axes = fg._figure(3.5 * len(names), 3.2, ncols=len(names))
    x = np.asarray(table["epoch"], dtype=float)
    for ax, name in zip(axes, names):
        ax.plot(x, table[name], marker="o", color="C0")
        ax.set(xlabel="epoch", title=LABELS[name])
        fg._integer_ticks(ax)
        ax.grid(alpha=0.3)
    return fg._save(fig, path)


def _study_sentence(name: str) -> str:
    within, runs = within_run_rho(name)
    across, n = study_rho(name)
    parts = ([f"along the epochs of {runs} full-length runs its Spearman correlation with the "
              f"kNN monitor was {within:+.2f} on average ({VERDICTS_FILE})"]
             if within is not None else [])
    parts += ([f"across {n} encoders of 3-epoch runs, {across:+.2f} ({STUDY_FILE})"]
              if across is not None else [])
    if not parts:
        return "Not yet checked against accuracy on this project's data."
    return f"In this project's studies {'; '.join(parts)}: {ROLE[name]}."


def labelfree_section(outputs: RunOutputs, fig_dir: Path) -> Section:
    """The verdict, then the label-free numbers: table (init -> end), curves, one reading each."""
    pre = outputs.metrics.get("pretrain")
    sec = Section("Quality without labels")
    if pre is None or pre.get("rankme") is None:
        sec.blocks.append(Paragraph(
            f"Label-free numbers and verdict: {NOT_AVAILABLE} (eval/metrics/pretrain.json has "
            "none: the monitor did not run, because pretrain.knn_every_epochs or pretrain."
            "labelfree_images is 0 or no pretraining images were built; or an older run)."))
        return sec
    said = report_sentence(pre)
    sec.blocks.append(Paragraph(said if said is not None else (
        "Verdict without labels: none (eval/metrics/pretrain.json holds none: the monitor's "
        "rows do not reach back to the random init, as after a resume with other monitor "
        "params, whose rows are dropped; or a run older than the verdict). Pretrain's log line "
        "'pretrain verdict: none (...)' says why.")))
    rows = [[LABELS[k], fmt(pre.get(f"{k}_init"), ".3f"), fmt(pre.get(k), ".3f"), ROLE[k]]
            for k in METRICS]
    sec.blocks.append(Table(["number", "random init", "end of pretraining", "what it answers"],
                            rows))
    table = outputs.plots.get("labelfree")
    if table is not None and fg._has(table, "epoch") and any(fg._has(table, k) for k in METRICS):
        plot_labelfree(table, fig_dir / "labelfree.png")
        sec.blocks.append(FigureRef("labelfree.png", "Label-free numbers at every monitor point "
                                    "(pretrain.labelfree_images pretraining images, no labels; "
                                    "epoch 0 = random init)."))
    for k in METRICS:
        sec.blocks.append(Paragraph(f"{READING[k]} {_study_sentence(k)}"))
    return sec


def plot_label_efficiency(curve: Mapping[str, Any], alls: Mapping[tuple[str, str], float],
                          all_per_class: float, path: Path) -> Path:
    """Top-1 against labelled images per class (log x), mean +- std, one panel per probe.

    The all-labels stars of one panel share one x; each is drawn :data:`STAR_GAP_PT` points
    beside the previous one, so two stars of (nearly) the same top-1 both stay visible.

    Args:
        curve: ``{kind: {probe: {str(n): {"mean", "std", ...}}}}`` (top-1 in percent).
        alls: ``(kind, probe) -> top-1`` with every train label, drawn as a star.
        all_per_class: where the stars go: train images / classes.
        path: the PNG to write.
    """
    from matplotlib.transforms import ScaledTranslation

    fig, axes = fg._figure(10.5, 3.8, ncols=2)
    for ax, probe in zip(axes, ("knn", "linear")):
        ax.set_xscale("log")
        ax.margins(x=0.1, y=0.08)  # room for the stars drawn beside their x (log: ~0.4 decade)
        starred = [kind for kind in curve if (kind, probe) in alls]
        for i, (kind, probes) in enumerate(curve.items()):
            points = probes[probe]
            n = np.array([int(k) for k in points], dtype=float)
            mean = np.array([points[k]["mean"] for k in points])
            std = np.array([points[k]["std"] for k in points])
            colour = f"C{i}"
            ax.plot(n, mean, marker="o", color=colour, label=KIND_NAMES.get(kind, kind))
            ax.fill_between(n, mean - std, mean + std, color=colour, alpha=0.2)
            if kind in starred:  # side by side around x, so equal numbers cannot hide a star
                shift = STAR_GAP_PT * (starred.index(kind) - (len(starred) - 1) / 2) / 72
                # a line with an offset transform is left out of autoscaling: its point is not
                ax.update_datalim([(all_per_class, alls[(kind, probe)])])
                ax.plot([all_per_class], [alls[(kind, probe)]], marker="*",
                        markersize=STAR_SIZE_PT, color=colour, linestyle="none",
                        transform=ax.transData + ScaledTranslation(shift, 0, fig.dpi_scale_trans))
        ax.autoscale_view()
        ax.set(xlabel="labelled images per class (star: all)", ylabel="top-1 (%)",
               title="kNN" if probe == "knn" else "linear probe")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    return fg._save(fig, path)


def _alls(m: Mapping[str, Metrics | None]) -> dict[tuple[str, str], float]:
    out = {}
    for key, (stage, name) in ALL_LABELS.items():
        v = m.get(stage).get(name) if m.get(stage) is not None else None
        if v is not None:
            out[key] = v
    return out


def _knn_words(m: Metrics | None, k_key: str, t_key: str, chosen: bool) -> str:
    k, t = m.get(k_key) if m else None, m.get(t_key) if m else None
    if k is None or t is None:
        return f"k, T {NOT_AVAILABLE}"
    return f"k={k:.0f}, T={t:g}" + (" chosen on held-out train images" if chosen else "")


def stars_caption(m: Mapping[str, Metrics | None]) -> str:
    """What the all-labels stars of the label-efficiency figure are, protocol by protocol.

    The stars are the pipeline's own numbers (:data:`ALL_LABELS`), whose kNN k and T differ
    from the curve's and from one another: the sentence names each.
    """
    knn, base = m.get("knn"), m.get("baselines")
    chosen = bool(knn and knn.get("select_val"))
    return ("Stars, side by side at the train images per class: the pipeline's numbers with "
            f"every train label; kNN: MoCo {_knn_words(knn, 'k', 'T', chosen)}, raw pixels "
            f"{_knn_words(base, 'raw_pixels_knn_tuned_k', 'raw_pixels_knn_tuned_T', True)}, "
            f"random encoder k={DEFAULT_K}, T={DEFAULT_T:g}; linear: the linear and baselines "
            "stages' probes.")


def margin_sentence(curve: Mapping[str, Any]) -> str:
    """What MoCo gains over raw pixels at :data:`MARGIN_AT` labels per class, per probe."""
    parts, beats = [], []
    for probe, name in (("knn", "kNN"), ("linear", "linear probe")):
        moco = curve.get("moco", {}).get(probe, {}).get(MARGIN_AT)
        raw = curve.get("raw_pixels", {}).get(probe, {}).get(MARGIN_AT)
        if moco is None or raw is None:
            continue
        d = moco["mean"] - raw["mean"]
        beats.append(d > moco["std"] + raw["std"])
        parts.append(f"{name} {moco['mean']:.2f} % against {raw['mean']:.2f} % "
                     f"({d:+.2f} points; spread over draws {moco['std']:.2f} and "
                     f"{raw['std']:.2f})")
    if not parts:
        return f"No point at {MARGIN_AT} labels per class (label_efficiency.per_class)."
    verdict = ("MoCo beats raw pixels by more than the spread of the draws" if all(beats)
               else "MoCo does NOT beat raw pixels by more than the spread of the draws"
               if not any(beats) else "MoCo beats raw pixels by more than the spread for one "
               "probe only")
    return (f"With {MARGIN_AT} labelled images per class: {'; '.join(parts)}. {verdict}.")


def label_efficiency_section(outputs: RunOutputs, fig_dir: Path) -> Section:
    """The label-efficiency curve and the margin at 10 labels per class."""
    sec = Section("Label efficiency")
    le = outputs.label_efficiency
    if le is None:
        sec.blocks.append(Paragraph(f"Label efficiency: {NOT_AVAILABLE} "
                                    "(eval/metrics/label_efficiency.json)."))
        return sec
    curve = le["curve"]
    names = outputs.test_class_names or next(
        (d.class_names for d in outputs.details.values() if d is not None), None)
    known = bool(names) and bool(le.get("train_images"))  # where the stars go
    plot_label_efficiency(curve, _alls(outputs.metrics) if known else {},
                          float(le.get("train_images", 0)) / len(names or [1]),
                          fig_dir / "label_efficiency.png")
    stars = (stars_caption(outputs.metrics) if known else
             f"No stars: the train images per class are {NOT_AVAILABLE} (no class names).")
    sec.blocks.append(FigureRef(
        "label_efficiency.png",
        f"Top-1 on the whole test set from n labelled train images per class (mean and spread "
        f"over {le.get('draws')} seeded draws, the same draws for every kind; kNN k={DEFAULT_K} "
        f"capped at the bank, T={DEFAULT_T:g}; the linear probe of the linear params). {stars}"))
    points = next(iter(curve.values()))["knn"]
    ns = list(points)
    rows = [[KIND_NAMES.get(kind, kind), probe] + [
        f"{probes[probe][n]['mean']:.2f} ± {probes[probe][n]['std']:.2f}" for n in ns]
        for kind, probes in curve.items() for probe in ("knn", "linear")]
    short = {n: p for n, p in points.items() if p.get("per_class_min", int(n)) < int(n)}
    sec.blocks.append(Table(["features", "probe"] + [
        f"{n}/class" + (f" (≥ {short[n]['per_class_min']})" if n in short else "")
        for n in ns], rows))
    if short:  # a class held fewer than asked: the point says what it used
        sec.blocks.append(Paragraph("Some classes hold fewer labelled train images than asked: "
                                    + "; ".join(f"at {n}/class the smallest class gives "
                                                f"{p['per_class_min']}, {p['labels']} labels in "
                                                "all" for n, p in short.items()) + "."))
    sec.blocks.append(Paragraph(margin_sentence(curve)))
    return sec
