"""DVC stage ``select_labels``: which pretraining images to label, picked without labels.

Writes ``selection/labels_to_collect.csv`` (``selection.method``'s picks for every budget of
``selection.budget``, for an annotator) and ``eval/selection.json`` (every method's picks); when
the pretraining images are the labelled train split, also how well each method's picks would
do once labelled (:mod:`pipeline.evaluate.run.select_labels`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params


def run(p: Params) -> None:
    from pathlib import Path

    from pipeline.data.remote import shards_location
    from pipeline.evaluate.run.select_labels import select_labels, write_selection
    from pipeline.tracking import stage_run

    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    with stage_run("select_labels", p, upstream=("data_insights", "embed")) as mlrun:
        result = select_labels(
            neighbourhoods_path=Path("features/insights.pt"), features_dir=Path("features"),
            shards_dir=shards, selection=p.selection, linear=p.linear, seed=p.seed)
        write_selection(result, p.selection, details_path=Path("eval/selection.json"),
                        csv_path=Path("selection/labels_to_collect.csv"),
                        metrics_path=Path("metrics/selection.json"),
                        all_metrics_path=Path("eval/metrics/selection.json"),
                        plots_path=Path("plots/selection.tsv"))
        from pipeline.atomic import read_json
        from pipeline.config import flatten

        mlrun.log_metrics(flatten(read_json(Path("metrics/selection.json")), "selection."))
        mlrun.log_artifact("selection/labels_to_collect.csv")
        mlrun.log_artifact("eval/metrics/selection.json")


if __name__ == "__main__":
    stage_entry("select_labels", run)
