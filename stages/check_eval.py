"""DVC stage ``check_eval``: whether there is anything to evaluate with labels.

``data.source: none`` (and a labelled source whose train or test split came out empty) builds
no labelled images. The evaluation stages after it (``embed``, ``baselines``, ``knn``,
``linear``, ``label_efficiency``) are then skipped cleanly, each writing its outputs as
"skipped" (:mod:`pipeline.evaluate.run.skipped`), and the report is built from what exists, so
``dvc repro`` exits 0. This stage reads the two manifests and writes a stamp whose bytes change
only with the answer (the dependants rerun when labels appear or go). Like ``check_params``
it logs no MLflow run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params


def run(p: Params) -> None:
    from pipeline.atomic import write_json
    from pipeline.data.remote import shards_location
    from pipeline.data.shards import missing_labels

    why = missing_labels(shards_location(p.data.shards_dir))
    write_json("runs/check_eval.json", {"stage": "check_eval", "run_id": None,
                                        "labelled": why is None, "skipped": why})


if __name__ == "__main__":
    stage_entry("check_eval", run)
