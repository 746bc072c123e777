"""DVC stage ``check_data``: refuse the params that only the built or indexed data can refute.

``check_params`` validates params.yaml alone. Some limits depend on the data: ``moco.K`` must be
below the number of pretraining images (moco#146), which only the manifests know for an
unlabelled tree, an imagefolder or shards read in place. Checked inside ``pretrain``, a refusal
would come after DVC had deleted pretrain's outputs; this stage runs between ``build_shards`` /
``index_shards`` and ``pretrain`` instead, reads only the manifests, and writes a
content-stable stamp (the same bytes whenever the check passes) that ``pretrain`` and ``embed``
depend on, so a refusal stops ``dvc repro`` before either is touched, and a pass reruns nothing.
Like ``check_params`` it logs no MLflow run (it produces nothing to track).

``index_shards`` refuses ``moco.K`` and a colour ``augment.preset`` on grey images already, from
the index and the params, before ``build_shards`` deletes the shards
(:func:`pipeline.data.checks.check_before_build`); this stage is the second line, on the manifests
as built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params

STAMP = {"stage": "check_data", "run_id": None, "data": "fits the params"}


def run(p: Params) -> None:
    from pipeline.atomic import write_json
    from pipeline.data.checks import check_against_data
    from pipeline.data.index import index_location, pretrain_manifest
    from pipeline.data.remote import shards_location

    shards = shards_location(p.data.shards_dir)
    # data.pretrain_shards is no dvc.yaml param here: only whether it is set matters, and the
    # index manifest (a dep) changes with that, not with a respelling of the same shards
    index = index_location("pretrain") if p.data.pretrain_shards else None
    pretrain_set = pretrain_manifest(shards, index, image_size=p.data.image_size)
    check_against_data(p, pretrain_set, shards / "pretrain")
    write_json("runs/check_data.json", STAMP)


if __name__ == "__main__":
    stage_entry("check_data", run)
