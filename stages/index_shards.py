"""DVC stage ``index_shards``: the identity of WebDataset shards read in place (no image copied).

Indexes ``data.pretrain_shards`` (into ``data/index/pretrain``) and, when ``data.source`` is
``webdataset``, the labelled shards of ``data.root`` (``data/index/labelled``):
:mod:`pipeline.data.index`. ``dvc.yaml`` marks it ``always_changed``: it runs at every
``dvc repro`` to ask the shards' servers for changes (one HEAD per shard; unchanged shards are
not read), and rewrites byte-identical manifests when nothing changed, so nothing downstream
reruns. Without shards to index it writes empty manifests and logs no MLflow run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params


def run(p: Params) -> None:
    import json
    import logging
    import sys

    from pipeline.atomic import write_json
    from pipeline.data.index import (
        MANIFEST_NAME,
        VALIDATORS,
        index_location,
        index_shards,
        read_previous,
    )
    from pipeline.tracking import stage_run

    sets = {"pretrain": (p.data.pretrain_shards, "data.pretrain_shards"),
            "labelled": (p.data.root if p.data.source == "webdataset" else "", "data.root")}
    if not any(spec for spec, _ in sets.values()):
        for split in sets:
            write_json(index_location(split) / MANIFEST_NAME, index_shards(
                "", split=split, key="", max_broken_fraction=0)[0])
        write_json(VALIDATORS, {})
        logging.getLogger("index_shards").info("no WebDataset shards to index "
                                               "(data.pretrain_shards and data.source)")
        return
    try:
        validators = json.loads(VALIDATORS.read_text())
    except (OSError, ValueError):
        validators = {}
    with stage_run("index_shards", p) as mlrun:
        manifests, fresh = {}, {}
        for split, (spec, key) in sets.items():
            manifests[split], found = index_shards(
                spec, split=split, key=key, max_broken_fraction=p.data.max_broken_fraction,
                previous=read_previous(split), validators=validators)
            fresh.update(found)
        for split, m in manifests.items():
            write_json(index_location(split) / MANIFEST_NAME, m)
            mlrun.log_metrics({f"{split}_shards": len(m["shards"]),
                               f"{split}_images": m["num_samples"],
                               f"{split}_broken_skipped": m["num_broken"]})
            if m["shards"]:
                mlrun.log_artifact(index_location(split) / MANIFEST_NAME, f"index/{split}")
        write_json(VALIDATORS, fresh)
        print(json.dumps({s: {"shards": len(m["shards"]), "images": m["num_samples"],
                              "broken_skipped": m["num_broken"]} for s, m in manifests.items()},
                         sort_keys=True),
              file=sys.stderr)


if __name__ == "__main__":
    stage_entry("index_shards", run)
