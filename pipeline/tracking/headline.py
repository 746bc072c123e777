"""The headline numbers: their MLflow names, and the lines ``dvc repro`` ends with.

The numbers a user compares between runs are the top-1 accuracies of MoCo's features beside
the baselines measured on the same images. :data:`HEADLINES` is the one list of them: where
each is read (a metrics file and a key in it) and its MLflow name. The names share the prefix
``top1.`` and then name the probe, so they sort together, each probe's baselines beside it::

    top1.knn              MoCo features, kNN (metrics/knn.json top1)
    top1.knn.labels_1     ... from 1 labelled image per class (label_efficiency)
    top1.knn.labels_10    ... from 10
    top1.knn.pixels       raw pixels, kNN with k and T chosen on held-out train images
    top1.knn.random       a randomly initialised encoder of the same architecture, kNN
    top1.linear           MoCo features, linear probe
    top1.linear.labels_1  ... (as for kNN)
    top1.linear.labels_10
    top1.linear.pixels    raw pixels, linear probe with the same protocol

The stage that measures a number logs it under its headline name (:func:`headline_metrics`),
and the report stage logs them all, so its run is one row of the runs table holding every
headline (the saved view of :mod:`pipeline.tracking.ui` shows them). :func:`summary_lines` are the
few lines the report stage prints last. A number absent from its file (no labels, a
label-efficiency draw not made) is left out, never shown as 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.atomic import PERCENT_DECIMALS, read_json

PREFIX = "top1."


@dataclass(frozen=True)
class Headline:
    """One headline number.

    Attributes:
        name: the MLflow metric name (``top1.<probe>[.<what>]``).
        file: the metrics file that holds it, relative to the repo root.
        key: its key there, dots for nested objects (``knn.1``).
        label: what it is, in the console line of its probe ("" for MoCo's own numbers).
        labels: labelled images per class it was measured from (0 = every labelled image).
    """

    name: str
    file: str
    key: str
    label: str = ""
    labels: int = 0

    @property
    def probe(self) -> str:
        """``knn`` or ``linear``: the second part of the name."""
        return self.name.split(".")[1]


KNN, LINEAR, BASELINES, LABELS = ("metrics/knn.json", "metrics/linear.json",
                                  "metrics/baselines.json", "metrics/label_efficiency.json")


# In the order the console prints them (a probe's own number first); the names sort the same.
HEADLINES: tuple[Headline, ...] = (
    Headline("top1.knn", KNN, "top1"),
    Headline("top1.knn.labels_1", LABELS, "knn.1", labels=1),
    Headline("top1.knn.labels_10", LABELS, "knn.10", labels=10),
    Headline("top1.knn.pixels", BASELINES, "pixels_knn", "raw pixels"),
    Headline("top1.knn.random", BASELINES, "random_knn", "random encoder"),
    Headline("top1.linear", LINEAR, "top1"),
    Headline("top1.linear.labels_1", LABELS, "linear.1", labels=1),
    Headline("top1.linear.labels_10", LABELS, "linear.10", labels=10),
    Headline("top1.linear.pixels", BASELINES, "pixels_linear", "raw pixels"),
)


PROBE_LABELS = {"knn": "kNN", "linear": "linear"}


def _lookup(obj: Any, key: str) -> float | None:
    """The number at dotted ``key`` of a nested dict, None when absent or not a number."""
    for part in key.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        return None
    return float(obj)


def headline_from(file: str, metrics: dict[str, Any] | None) -> dict[str, float]:
    """The headline numbers of one metrics file's content, by MLflow name.

    Args:
        file: the file's path as :data:`HEADLINES` names it (``metrics/knn.json``).
        metrics: its content (as written); None = nothing.

    Returns:
        ``{"top1.knn": 87.01}``: the entries of ``file`` that ``metrics`` holds, rounded to
        0.01 pt (a label-efficiency mean over draws has more digits).
    """
    out = {}
    for h in HEADLINES:
        value = _lookup(metrics, h.key) if h.file == file else None
        if value is not None:  # a top-1 in %: 0.01 pt, as the metrics files write top-1s
            out[h.name] = round(value, PERCENT_DECIMALS)
    return out


def headline_metrics(*files: str, root: Path | None = None) -> dict[str, float]:
    """The headline numbers held by metrics files on disk, by MLflow name.

    Args:
        files: the metrics files to read (relative to ``root``); none = every file of
            :data:`HEADLINES`.
        root: the repo root (default: the current directory).

    Returns:
        ``{"top1.knn": 87.01, ...}`` in :data:`HEADLINES` order; a number its file lacks
        (or a missing or unreadable file) is left out.
    """
    root = Path.cwd() if root is None else Path(root)
    found: dict[str, float] = {}
    for f in dict.fromkeys(files or (h.file for h in HEADLINES)):
        found.update(headline_from(f, read_json(root / f)))
    return {h.name: found[h.name] for h in HEADLINES if h.name in found}


REPORT_STAGE = "report"  # its run holds every headline number: one row per pipeline run


def stage_headline(stage: str, root: Path | None = None) -> dict[str, float]:
    """The headline numbers a stage's run holds (:func:`headline_metrics`).

    Those of ``metrics/<stage>.json``; all of them for the report stage; ``{}`` for a stage
    that measures none.
    """
    if stage == REPORT_STAGE:
        return headline_metrics(root=root)
    mine = f"metrics/{stage}.json"
    return headline_metrics(mine, root=root) if any(h.file == mine for h in HEADLINES) else {}


def summary_lines(values: dict[str, float], *, report: str | Path | None = None,
                  runs_url: str | None = None) -> list[str]:
    """The lines the report stage prints last: each probe's top-1 beside its baselines.

    Args:
        values: :func:`headline_metrics`.
        report: the report's path (a line ``report: <path>``), None = no line.
        runs_url: the MLflow runs table (a line ``MLflow: <url>``), None = no line.

    Returns:
        One line per probe whose own number is known, e.g. ``kNN top-1 87.01 % (raw pixels
        81.78 %, random encoder 78.36 %)``; one line for the few-label numbers, e.g. ``from 1,
        10 labelled images per class: kNN 54.11 %, 71.68 %; linear 51.29 %, 71.49 %`` (``-``
        where one is missing); then the report and MLflow lines.
    """
    lines, few = [], []
    counts = sorted({h.labels for h in HEADLINES if h.labels and h.name in values})
    for probe, word in PROBE_LABELS.items():
        own = [h for h in HEADLINES if h.probe == probe]
        main = values.get(own[0].name)
        rest = [f"{h.label} {values[h.name]:.2f} %" for h in own[1:]
                if h.name in values and not h.labels]
        if main is not None:
            lines.append(f"{word} top-1 {main:.2f} %" + (f" ({', '.join(rest)})" if rest else ""))
        by_count = {h.labels: values.get(h.name) for h in own if h.labels}
        if any(by_count.get(n) is not None for n in counts):
            few.append(f"{word} " + ", ".join("-" if by_count.get(n) is None
                                              else f"{by_count[n]:.2f} %" for n in counts))
    if few:
        lines.append(f"from {', '.join(map(str, counts))} labelled images per class: "
                     + "; ".join(few))
    if report is not None:
        lines.append(f"report: {report}")
    if runs_url is not None:
        lines.append(f"MLflow: {runs_url}")
    return lines


def headline_names(probes: Iterable[str] = PROBE_LABELS) -> list[str]:
    """The MLflow names of :data:`HEADLINES` of these probes, sorted (the UI's column order)."""
    return sorted(h.name for h in HEADLINES if h.probe in set(probes))
