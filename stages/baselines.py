"""DVC stage ``baselines``: kNN on raw pixels and on a random-init encoder, for context."""

import sys
from pathlib import Path

from pipeline.cli import stage_main
from pipeline.config import Params
from pipeline.data.remote import shards_location
from pipeline.tracking import stage_run, write_json_atomic


def run(p: Params) -> None:
    from pipeline.evaluate.run import baselines

    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    with stage_run("baselines", p, upstream=("build_shards",)) as mlrun:
        metrics = baselines(shards_dir=shards, model=p.model, seed=p.seed,
                            batch_size=p.embed.batch_size)
        write_json_atomic(Path("metrics/baselines.json"), metrics)
        mlrun.log_metrics(metrics)


if __name__ == "__main__":
    sys.exit(stage_main("baselines", run))
