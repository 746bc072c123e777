"""DVC stage ``knn``: weighted kNN classifier on frozen features (k, T from params)."""

import sys
from pathlib import Path

from pipeline.cli import stage_main
from pipeline.config import Params
from pipeline.data.remote import shards_location
from pipeline.tracking import stage_run, write_json_atomic


def run(p: Params) -> None:
    from pipeline.evaluate.run import knn_eval

    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    with stage_run("knn", p, upstream=("embed", "pretrain")) as mlrun:
        metrics = knn_eval(features_dir=Path("features"),
                           manifest_dir=shards / "test", knn=p.knn,
                           details_path=Path("eval/knn_details.json"))
        write_json_atomic(Path("metrics/knn.json"), metrics)
        mlrun.log_metrics(metrics)
        mlrun.log_artifact("eval/knn_details.json")


if __name__ == "__main__":
    sys.exit(stage_main("knn", run))
