"""DVC stage ``check_eval``: refuse an evaluation without labelled images before embed runs.

``data.source: none`` (and a labelled source whose train or test split came out empty) builds
no labelled images: ``dvc repro pretrain`` gives the encoder, but the evaluation stages need a
labelled source. Refused inside ``embed``, the error would come after DVC had deleted the
previous features; this stage sits before ``embed`` (its only dependant), reads the two
manifests and writes a content-stable stamp, so ``dvc repro`` stops with one line and every
output is kept. ``dvc repro pretrain`` does not run it. Like ``check_params`` it logs no MLflow
run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params

STAMP = {"stage": "check_eval", "run_id": None, "data": "labelled train and test images"}


def run(p: Params) -> None:
    from pipeline.atomic import write_json
    from pipeline.data.manifest import read_manifest
    from pipeline.data.remote import shards_location
    from pipeline.data.shards import require_images

    shards = shards_location(p.data.shards_dir)
    for split in ("train", "test"):
        require_images(read_manifest(shards / split), shards / split)
    write_json("runs/check_eval.json", STAMP)


if __name__ == "__main__":
    stage_entry("check_eval", run)
