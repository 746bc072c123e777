"""DVC stage ``knn``: weighted kNN classifier on frozen features (k, T from params)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params


def run(p: Params) -> None:
    from pathlib import Path

    from pipeline.atomic import headline, write_metrics
    from pipeline.data.remote import shards_location
    from pipeline.evaluate.run.knn import HEADLINE, knn_eval
    from pipeline.evaluate.run.skipped import skip_without_labels
    from pipeline.tracking import stage_run
    from pipeline.tracking.registry import attach_scores, trusted_encoder

    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    if skip_without_labels("knn", shards):  # data.source none: outputs say why, exit 0
        return
    with stage_run("knn", p, upstream=("embed", "pretrain")) as mlrun:
        mlrun.log_shards(shards / "train", context="evaluation")
        test = mlrun.log_shards(shards / "test", context="evaluation")
        metrics = knn_eval(features_dir=Path("features"),
                           manifest_dir=shards / "test", knn=p.knn,
                           details_path=Path("eval/knn_details.json"), seed=p.seed)
        write_metrics(Path("eval/metrics/knn.json"), metrics)
        write_metrics(Path("metrics/knn.json"), headline(metrics, HEADLINE))
        mlrun.log_metrics(metrics)
        encoder = trusted_encoder(mlrun, params=p, encoder_path=Path("models/encoder.pt"),
                                  example_split=shards / "test")  # found by its md5
        attach_scores(mlrun, "knn", metrics, encoder=encoder, dataset=test)  # knn.top1 on it
        mlrun.log_artifact("eval/knn_details.json")


if __name__ == "__main__":
    stage_entry("knn", run)
