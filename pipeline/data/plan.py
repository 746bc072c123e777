"""The pretraining set as the params and the indexes fix it, before ``build_shards`` runs.

``index_shards`` plans the set (:func:`plan_pretraining`) from the params, the folder index
(:mod:`pipeline.data.folder_index`) and the shard indexes (:mod:`pipeline.data.index`), and
refuses what the data refutes (:func:`pipeline.data.checks.check_before_build`) before the
build deletes anything. The plan follows the rules of the sources that will build the set: the
split sizes of a webdataset source, the folder mode rule of
:class:`pipeline.data.sources.unlabelled.PretrainMix`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.data.checks import PRETRAIN_IMAGES, SOURCE_MODES
from pipeline.data.manifest import Manifest
from pipeline.data.modes import folder_mode
from pipeline.data.sources.webdataset import split_sizes

if TYPE_CHECKING:
    from pipeline.config import DataParams


@dataclass(frozen=True)
class PretrainPlan:
    """The pretraining set as the params and the index fix it, before ``build_shards`` runs.

    Attributes:
        images: N, the number of pretraining images the build and the index will give.
        images_from: its parts, for messages (``3 in data.unlabelled_root /data/photos``).
        mode: ``L`` or ``RGB``, the mode the pretraining images are trained in.
        mode_from: what decides it, for messages.
    """

    images: int
    images_from: str
    mode: str
    mode_from: str


def plan_pretraining(data: DataParams, *, folders: Mapping[str, dict[str, Any]],
                     manifests: Mapping[str, Manifest]) -> PretrainPlan:
    """The size and mode of the pretraining set, from the params and the index alone.

    ``index_shards`` refuses with it what the data refutes (``moco.K >= N``, a colour
    ``augment.preset`` on grey images) before ``build_shards`` deletes the shards; ``check_data``
    checks the built manifests again (:func:`pipeline.data.checks.check_against_data`).

    N is the built part, capped by ``data.max_pretrain_images`` (the build writes exactly
    ``min(cap, n)``), plus the indexed ``data.pretrain_shards``. The built part is the labelled
    source's pretrain split when ``data.pretrain_labelled`` (a fixed-size source's
    :data:`pipeline.data.checks.PRETRAIN_IMAGES`; an imagefolder's train split, ``train_images`` of
    its folder index; a webdataset set's train split plus its unlabelled samples,
    :func:`pipeline.data.sources.webdataset.split_sizes`) and the tree's images minus its
    broken ones.

    The mode follows :func:`pipeline.data.index.pretrain_manifest` (the evaluation data's
    decides) and the folder rule of :class:`pipeline.data.sources.unlabelled.PretrainMix`: with
    labelled images, ``L`` when they and the tree are all grey, else ``RGB``; without, the
    tree's; with neither, the indexed shards' own.

    Args:
        data: the data params.
        folders: :func:`pipeline.data.folder_index.index_params_folders` (each entry's
            ``mode``, ``images``, ``broken``; ``data.root``'s ``train_images``).
        manifests: :func:`pipeline.data.index.index_sets` (``pretrain``, and ``labelled`` with
            label summaries for a ``webdataset`` source).

    Raises:
        SourceError: a webdataset split left empty
            (:func:`pipeline.data.sources.webdataset.split_sizes`).
    """
    source = str(data.source)
    if source == "imagefolder":
        entry = folders["data.root"]
        labelled, label_mode = int(entry["train_images"]), entry["mode"]
        named = f"data.source imagefolder, data.root {data.root}"
    elif source == "webdataset":
        index = manifests["labelled"]
        labelled = split_sizes(index, data.test_fraction, data.root)["pretrain"]
        label_mode, named = index.mode, f"data.source webdataset, data.root {data.root}"
    elif source == "none":
        labelled, label_mode, named = 0, None, ""
    else:
        labelled = PRETRAIN_IMAGES[data.source]
        label_mode, named = SOURCE_MODES[data.source], f"data.source {source}"
    parts, built = [], 0
    if data.pretrain_labelled and labelled:
        parts.append(f"{labelled} of {named}")
        built += labelled
    tree = folders.get("data.unlabelled_root") if data.unlabelled_root else None
    if tree is not None:
        n_broken = len(tree.get("broken", []))
        left = f" ({n_broken} broken left out)" if n_broken else ""
        parts.append(f"{tree['images'] - n_broken} in data.unlabelled_root {tree['root']}{left}")
        built += tree["images"] - n_broken
    cap = data.max_pretrain_images
    if cap and built > cap:
        parts = [f"data.max_pretrain_images {cap} of {' + '.join(parts)}"]
        built = cap
    ext = manifests["pretrain"]
    if ext.num_samples:
        parts.append(f"{ext.num_samples} in data.pretrain_shards ({len(ext.shards)} shards)")
    if label_mode is not None:
        kinds = {label_mode} | ({tree["mode"]} if tree is not None else set())
        mode = folder_mode(kinds)
        mode_from = named + (f" and data.unlabelled_root {tree['root']}" if tree else "")
    elif tree is not None:
        mode, mode_from = tree["mode"], f"data.unlabelled_root {tree['root']}"
    else:
        mode, mode_from = ext.mode, "data.pretrain_shards, no labelled or folder images"
    return PretrainPlan(built + ext.num_samples, " + ".join(parts) or "none", mode,
                        mode_from)
