"""DVC stage ``index_shards``: the identity of WebDataset shards read in place (no image copied).

Indexes ``data.pretrain_shards`` (into ``data/index/pretrain``) and, when ``data.source`` is
``webdataset``, the labelled shards of ``data.root`` (``data/index/labelled``):
:mod:`pipeline.data.index`. ``dvc.yaml`` marks it ``always_changed``: it runs at every
``dvc repro`` to ask the shards' servers for changes (one HEAD per shard; unchanged shards are
not read) and leaves the manifests as they are when nothing changed, so nothing downstream
reruns. An index that changed is written and logged as one MLflow run (``runs/index_shards.json``
names it: the lineage of the pretraining data); without shards to index it writes empty
manifests and logs no MLflow run. It also lists the local image folders that ``build_shards``
reads (``data.unlabelled_root``; ``data.root`` of an ``imagefolder`` source) into
``data/index/folders.json`` (:func:`pipeline.data.folder_index.index_folders`), so an image
added to a folder rebuilds the shards and a missing folder, or a new image that does not
decode (a bad header, or a file cut short past a good one), stops ``dvc repro`` before they
are deleted (the images are decoded again only when a listing changed). The labels of a
``webdataset`` labelled set are read as the build reads them and refused here when the build
would refuse them.

Before writing anything it also refuses what the indexed data refutes in the params, while
every output of every stage is as it was (DVC deletes ``build_shards``' outputs next):
``moco.K`` at least the number of pretraining images, and a colour ``augment.preset`` on grey
ones (:func:`pipeline.data.plan.plan_pretraining`,
:func:`pipeline.data.checks.check_before_build`); ``v2_grey`` on colour images is logged as a
warning.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params


def run(p: Params) -> None:
    from pipeline.atomic import write_json
    from pipeline.cores import resolve_workers
    from pipeline.data.checks import check_before_build
    from pipeline.data.folder_index import FOLDERS, index_params_folders, read_previous_folders
    from pipeline.data.index import VALIDATORS, index_sets
    from pipeline.data.plan import plan_pretraining

    before = read_previous_folders()
    folders = index_params_folders(p.data)  # first: a missing folder stops before any shard
    sets = {"pretrain": (p.data.pretrain_shards, "data.pretrain_shards"),
            "labelled": (p.data.root if p.data.source == "webdataset" else "", "data.root")}
    manifests, fresh, changed = index_sets(
        sets, max_broken_fraction=p.data.max_broken_fraction,
        label_fields={"labelled": p.data.label_field},
        workers=resolve_workers(p.data.build_workers))  # the same manifests for any count
    # what the data refutes, refused before anything is written (and before build_shards)
    check_before_build(p, plan_pretraining(p.data, folders=folders, manifests=manifests))
    summary = {s: {"shards": len(m.shards), "images": m.num_samples,
                   "broken_skipped": m.num_broken} for s, m in manifests.items()}
    runs_file = Path("runs/index_shards.json")
    if changed or not runs_file.is_file():  # unchanged: the manifests are left as they are
        _write_index(p, manifests, summary, runs_file)
    write_json(VALIDATORS, fresh)
    write_json(FOLDERS, folders)
    listed = {key: (f["images"], len(f.get("broken", [])), (before or {}).get(key) == f)
              for key, f in folders.items()}
    shard_sets = {key: (summary[s]["shards"], summary[s]["images"],
                        summary[s]["broken_skipped"], not changed)
                  for s, (spec, key) in sets.items() if spec}
    for line in index_summary(shard_sets, listed):
        print(f"index_shards: {line}", file=sys.stderr)


def _write_index(p: Params, manifests: dict, summary: dict, runs_file: Path) -> None:
    """Write the manifests; one MLflow run per new index of shards, none without shards."""
    from pipeline.atomic import write_json
    from pipeline.data.index import index_location
    from pipeline.data.manifest import MANIFEST_NAME, write_manifest
    from pipeline.tracking import stage_run

    if not any(m.shards for m in manifests.values()):
        for split, m in manifests.items():
            write_manifest(m, index_location(split))
        write_json(runs_file, {"stage": "index_shards", "run_id": None})
        return
    with stage_run("index_shards", p) as mlrun:
        for split, m in manifests.items():
            write_manifest(m, index_location(split))
            mlrun.log_metrics({f"{split}_{k}": v for k, v in summary[split].items()})
            if m.shards:
                mlrun.log_artifact(index_location(split) / MANIFEST_NAME, f"index/{split}")


def index_summary(shard_sets: dict[str, tuple[int, int, int, bool]],
                  folders: dict[str, tuple[int, int, bool]]) -> list[str]:
    """What the index holds, one line per shard set and image folder, ``unchanged`` or not.

    Args:
        shard_sets: ``{param: (shards, images, broken skipped, unchanged)}`` of the shard sets
            read in place that the params name.
        folders: ``{param: (images, broken skipped, unchanged)}`` of the image folders.

    Returns:
        E.g. ``data.pretrain_shards: unchanged (3 shards, 119 images, 1 broken skipped)``;
        one line saying there is nothing to index when nothing is named.
    """
    def counts(*parts: str, broken: int) -> str:
        return ", ".join([*parts, *([f"{broken:,} broken skipped"] if broken else [])])

    lines = [f"{key}: {'unchanged' if same else 'indexed'} "
             f"({counts(f'{n:,} shards', f'{images:,} images', broken=broken)})"
             for key, (n, images, broken, same) in shard_sets.items()]
    lines += [f"{key}: {'unchanged' if same else 'listed'} "
              f"({counts(f'{images:,} images', broken=broken)})"
              for key, (images, broken, same) in folders.items()]
    return lines or ["nothing to index (no data.pretrain_shards, no webdataset data.root, no "
                     "image folder)"]


if __name__ == "__main__":
    stage_entry("index_shards", run)
