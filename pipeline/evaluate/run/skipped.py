"""The evaluation stages without labels: skipped cleanly, their outputs stating why.

With ``data.source: none`` (or a labelled source whose train or test split came out empty)
there is nothing to evaluate with labels, yet ``dvc repro`` must finish: the report still
shows what the run is for (the encoder, its label-free numbers and verdict, near-duplicates and
outliers). Each evaluation stage (``embed``, ``baselines``, ``knn``, ``linear``,
``label_efficiency``) first calls :func:`skip_without_labels`: when labels are missing it writes
every output ``dvc.yaml`` declares for the stage (the list is read from there, not kept here),
each saying it was skipped and why, logs one line, and the stage returns without an MLflow
run. A metrics file is ``{}`` (no numbers: ``dvc metrics show`` shows nothing for it), a
details file and ``runs/<stage>.json`` hold ``"skipped": why``, a plot holds no rows, a
feature file no images.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import write_atomic, write_json
from pipeline.data.remote import ShardURL
from pipeline.data.shards import missing_labels
from pipeline.evaluate.features import FeatureSet, save_features
from pipeline.stage_inputs import stage_spec

log = logging.getLogger(__name__)


def declared_outputs(spec: dict[str, Any]) -> list[Path]:
    """Every path a ``dvc.yaml`` stage entry declares: ``outs``, ``metrics`` and ``plots``."""
    out = []
    for kind in ("outs", "metrics", "plots"):
        for entry in spec.get(kind) or []:
            out.append(Path(next(iter(entry)) if isinstance(entry, dict) else entry))
    return out


def write_skipped(path: Path, stage: str, why: str) -> None:
    """One declared output of a skipped stage, saying so in its own format.

    Raises:
        ValueError: an output of a kind this module does not know (a new stage output: give
            it a placeholder here).
    """
    if path.suffix == ".pt":
        save_features(FeatureSet(torch.zeros(0, 0), torch.zeros(0, dtype=torch.int64), []), path)
    elif path.suffix == ".json" and path.parts[0] == "metrics":
        write_json(path, {})  # numbers only in metrics files: none
    elif path.suffix == ".json":
        write_json(path, {"stage": stage, "run_id": None, "skipped": why}
                   if path.parts[0] == "runs" else {"skipped": why})
    elif path.suffix == ".tsv":
        write_atomic(path, lambda fh: None)  # an empty file: no rows
    else:
        raise ValueError(f"{stage}: no placeholder for the output {path} of a skipped stage")


def skip_without_labels(stage: str, shards_dir: Path | ShardURL) -> bool:
    """Skip ``stage`` when there are no labelled train and test images; True when skipped.

    Args:
        stage: the stage name (its entry in ``./dvc.yaml`` lists the outputs written).
        shards_dir: holds the built ``train/`` and ``test/`` splits.

    Raises:
        ShardError: a split's manifest is missing or invalid.
    """
    why = missing_labels(shards_dir)
    if why is None:
        return False
    for path in declared_outputs(stage_spec(stage)):
        write_skipped(path, stage, why)
    log.warning("%s: skipped: %s; the report shows the label-free numbers, near-duplicates and "
                "outliers", stage, why)
    return True
