"""DVC stage ``label_efficiency``: kNN and linear-probe top-1 from a few labels per class.

MoCo features beside raw pixels and the random-init encoder, on the same seeded draws
(:mod:`pipeline.evaluate.label_efficiency`); the answer to "how many images must I label?".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params


def run(p: Params) -> None:
    from pathlib import Path

    from pipeline.data.remote import shards_location
    from pipeline.evaluate.run.label_efficiency import label_efficiency, write_label_efficiency
    from pipeline.evaluate.run.skipped import skip_without_labels
    from pipeline.tracking import stage_run

    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    if skip_without_labels("label_efficiency", shards):  # data.source none: outputs say why, exit 0
        return
    with stage_run("label_efficiency", p, upstream=("embed", "pretrain")) as mlrun:
        metrics = label_efficiency(
            features_dir=Path("features"), shards_dir=shards, model=p.model, seed=p.seed,
            linear=p.linear, per_class=p.label_efficiency.per_class,
            draws=p.label_efficiency.draws, layer=p.embed.layer, pool_grid=p.embed.pool_grid,
            batch_size=p.embed.batch_size)
        write_label_efficiency(metrics, metrics_path=Path("metrics/label_efficiency.json"),
                               details_path=Path("eval/metrics/label_efficiency.json"),
                               plots_path=Path("plots/label_efficiency.tsv"))
        # stage_run logs its headline points (top1.knn.labels_1, ...) and the whole curve as a
        # table and a figure (pipeline.tracking.runs.log_stage_outputs)
        mlrun.log_artifact("eval/metrics/label_efficiency.json")


if __name__ == "__main__":
    stage_entry("label_efficiency", run)
