"""DVC stage ``data_insights``: near-duplicates and outliers among the pretraining images.

Runs right after ``pretrain`` and needs no labels (``data.source: none`` too): the exported
encoder's global features of every pretraining image, each image's nearest others, the pairs
at cosine >= ``insights.duplicate_cosine`` and the most isolated images
(:mod:`pipeline.evaluate.run.data_insights`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params


def run(p: Params) -> None:
    from pathlib import Path

    from pipeline.atomic import headline, write_metrics
    from pipeline.data.index import index_location
    from pipeline.data.remote import shards_location
    from pipeline.evaluate.run.data_insights import HEADLINE, data_insights
    from pipeline.tracking import stage_run

    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    # as in pretrain: only whether data.pretrain_shards is set matters (the index is a dep)
    index = index_location("pretrain") if p.data.pretrain_shards else None
    with stage_run("data_insights", p, upstream=("pretrain",)) as mlrun:
        mlrun.log_shards(shards / "pretrain", context="training")
        if index is not None:
            mlrun.log_shards(index, context="training")
        metrics = data_insights(
            encoder_path=Path("models/encoder.pt"), head_path=Path("models/head.pt"),
            shards_dir=shards, index_dir=index, image_size=p.data.image_size, embed=p.embed,
            insights=p.insights, features_dir=Path("features"),
            details_path=Path("eval/data_insights.json"),
            neighbourhoods_path=Path("features/insights.pt"))
        write_metrics(Path("eval/metrics/data_insights.json"), metrics)
        write_metrics(Path("metrics/data_insights.json"), headline(metrics, HEADLINE))
        mlrun.log_metrics(metrics)
        mlrun.log_artifact("eval/data_insights.json")


if __name__ == "__main__":
    stage_entry("data_insights", run)
