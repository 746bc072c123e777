"""DVC stage ``embed``: frozen backbone features of the labelled train and test shards."""

import sys
from pathlib import Path

from pipeline.cli import stage_main
from pipeline.config import Params
from pipeline.data.remote import shards_location
from pipeline.tracking import stage_run, write_json_atomic


def run(p: Params) -> None:
    from pipeline.evaluate.run import embed

    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    with stage_run("embed", p, upstream=("pretrain",)) as mlrun:
        metrics = embed(encoder_path=Path("models/encoder.pt"), shards_dir=shards,
                        out_dir=Path("features"), batch_size=p.embed.batch_size,
                        use_head=p.embed.use_head, head_path=Path("models/head.pt"))
        write_json_atomic(Path("metrics/embed.json"), metrics)
        mlrun.log_metrics(metrics)


if __name__ == "__main__":
    sys.exit(stage_main("embed", run))
