"""DVC stage ``linear``: linear probe on the frozen backbone (MoCo protocol)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params


def run(p: Params) -> None:
    from pathlib import Path

    from pipeline.atomic import headline, write_metrics
    from pipeline.data.remote import shards_location
    from pipeline.evaluate.run.linear import HEADLINE, linear_probe
    from pipeline.evaluate.run.skipped import skip_without_labels
    from pipeline.tracking import stage_run
    from pipeline.tracking.registry import attach_scores, trusted_encoder, update_champion

    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    if skip_without_labels("linear", shards):  # data.source none: outputs say why, exit 0
        return
    with stage_run("linear", p, upstream=("embed", "pretrain")) as mlrun:
        mlrun.log_shards(shards / "train", context="evaluation")
        test = mlrun.log_shards(shards / "test", context="evaluation")
        metrics = linear_probe(features_dir=Path("features"), shards_dir=shards,
                               encoder_path=Path("models/encoder.pt"), linear=p.linear,
                               seed=p.seed, details_path=Path("eval/linear_details.json"),
                               plots_path=Path("plots/linear.tsv"),
                               pool_grid=p.embed.pool_grid, layer=p.embed.layer)
        write_metrics(Path("eval/metrics/linear.json"), metrics)
        write_metrics(Path("metrics/linear.json"), headline(metrics, HEADLINE))
        mlrun.log_metrics(metrics)
        encoder = trusted_encoder(mlrun, params=p, encoder_path=Path("models/encoder.pt"),
                                  example_split=shards / "test")  # found by its md5
        attach_scores(mlrun, "linear", metrics, encoder=encoder, dataset=test)  # tags its version
        update_champion(mlrun, encoder)  # alias champion: the best linear top-1 of all versions
        mlrun.log_artifact("eval/linear_details.json")
        mlrun.log_artifact("plots/linear.tsv")


if __name__ == "__main__":
    stage_entry("linear", run)
