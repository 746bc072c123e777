"""DVC stage ``embed``: frozen backbone features of the labelled train and test shards."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params


def run(p: Params) -> None:
    from pathlib import Path

    from pipeline.atomic import headline, write_metrics
    from pipeline.data.remote import shards_location
    from pipeline.evaluate.run.embed import HEADLINE, embed
    from pipeline.evaluate.run.skipped import skip_without_labels
    from pipeline.tracking import stage_run
    from pipeline.tracking.registry import link_encoder_input, trusted_encoder

    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    if skip_without_labels("embed", shards):  # data.source none: outputs say why, exit 0
        return
    with stage_run("embed", p, upstream=("pretrain",)) as mlrun:
        for split in ("train", "test"):
            mlrun.log_shards(shards / split, context="evaluation")
        # the registered version whose encoder.md5 is models/encoder.pt's (registered if none)
        encoder = trusted_encoder(mlrun, params=p, encoder_path=Path("models/encoder.pt"),
                                  example_split=shards / "test")
        link_encoder_input(mlrun, encoder)
        metrics = embed(encoder_path=Path("models/encoder.pt"), shards_dir=shards,
                        out_dir=Path("features"), batch_size=p.embed.batch_size,
                        use_head=p.embed.use_head, head_path=Path("models/head.pt"),
                        pool_grid=p.embed.pool_grid, layer=p.embed.layer,
                        reuse_dir=Path("features"))  # data_insights' features of the same shards
        write_metrics(Path("eval/metrics/embed.json"), metrics)
        write_metrics(Path("metrics/embed.json"), headline(metrics, HEADLINE))
        mlrun.log_metrics(metrics)


if __name__ == "__main__":
    stage_entry("embed", run)
