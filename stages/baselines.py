"""DVC stage ``baselines``: raw pixels (kNN, tuned kNN, linear probe) and a random encoder."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params


def run(p: Params) -> None:
    from pathlib import Path

    from pipeline.atomic import headline, write_metrics
    from pipeline.data.remote import shards_location
    from pipeline.evaluate.run.baselines import HEADLINE, baselines
    from pipeline.evaluate.run.skipped import skip_without_labels
    from pipeline.tracking import stage_run

    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    if skip_without_labels("baselines", shards):  # data.source none: outputs say why, exit 0
        return
    with stage_run("baselines", p, upstream=("build_shards",)) as mlrun:
        for split in ("train", "test"):
            mlrun.log_shards(shards / split, context="evaluation")
        metrics = baselines(shards_dir=shards, model=p.model, seed=p.seed, linear=p.linear,
                            batch_size=p.embed.batch_size, pool_grid=p.embed.pool_grid,
                            layer=p.embed.layer)
        write_metrics(Path("eval/metrics/baselines.json"), metrics)
        write_metrics(Path("metrics/baselines.json"), headline(metrics, HEADLINE))
        mlrun.log_metrics(metrics)


if __name__ == "__main__":
    stage_entry("baselines", run)
