"""DVC stage ``pretrain``: MoCo pretraining on the pretrain shards, export the query backbone.

Runs as a plain process or under ``torchrun --nproc_per_node N stages/pretrain.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

    from pipeline.config import Params
    from pipeline.data.remote import ShardURL

# Resume state: NOT a DVC output (gitignored and dvcignored). As a `persist: true, cache: false`
# output it switched off DVC's run cache for the stage and could not be restored by `dvc pull`
# or in a `--queue`/`--temp` workspace, so those retrained. Here it only serves a killed
# `dvc repro` in the same workspace; `last.pt` holds the fingerprint of the params, shards and
# training code it was made with, and a checkpoint with another fingerprint is never resumed.
CHECKPOINT_DIR = ".checkpoints/pretrain"


def run(p: Params) -> None:
    import os
    from pathlib import Path

    from pipeline.data.index import index_location, pretrain_manifest
    from pipeline.data.remote import shards_location
    from pipeline.tracking import stage_run
    from pipeline.train.engine import pretrain

    rank = int(os.environ.get("RANK", "0"))
    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    index = index_location("pretrain") if p.data.pretrain_shards else None
    pretrain_set = pretrain_manifest(shards, index, image_size=p.data.image_size)
    check_before_training(p, pretrain_set, shards / "pretrain")
    with stage_run("pretrain", p, upstream=("build_shards", "index_shards"), rank=rank,
                   system_metrics=True) as mlrun:
        mlrun.log_shards(shards / "pretrain", context="training")
        if index is not None:
            mlrun.log_shards(index, context="training")
        pretrain(model=p.model, moco=p.moco, opt=p.pretrain, augment=p.augment, seed=p.seed,
                 shards_dir=shards, encoder_path=Path("models/encoder.pt"),
                 checkpoint_dir=Path(CHECKPOINT_DIR),
                 metrics_path=Path("metrics/pretrain.json"),
                 plots_path=Path("plots/pretrain.tsv"),
                 knn_plots_path=Path("plots/knn_monitor.tsv"), run=mlrun,
                 pretrain_set=pretrain_set)
        for f in ("metrics/pretrain.json", "plots/pretrain.tsv", "plots/knn_monitor.tsv",
                  "models/encoder.json", "models/encoder.pt"):
            mlrun.log_artifact(f)


def check_before_training(p: Params, pretrain_set: dict[str, Any],
                          split: Path | ShardURL) -> None:
    """Refuse, before hours of training, what only the data can refute.

    * ``moco.K`` at least the number of pretraining images (moco#146): ``check_params``
      already refuses it when the params fix the count; with an unlabelled tree, an imagefolder
      or shards read in place only the manifests know it.
    * An ``embed.pool_grid`` the images cannot fill: ``check_params`` bounds it when the params
      fix the image side; an ``imagefolder`` built at ``data.image_size`` 0 keeps its images'
      own size, which only the manifest knows. (Shards of whole images, ``data.max_side``, vary
      in size: left to ``embed``.)

    Raises:
        ParamsError: either (names ``moco.K`` and both numbers, or ``embed.pool_grid`` and the
            manifest).
    """
    from pipeline.config import check_pool_grid, check_queue_size, image_side

    parts = pretrain_set.get("build", {}).get("parts") or [str(split)]
    check_queue_size(p.moco.K, int(pretrain_set["num_samples"]), " + ".join(parts))
    if p.embed.pool_grid <= 1 or image_side(p):
        return
    shape = pretrain_set.get("image_shape")  # (C, H, W); None = mixed sizes
    if shape:
        check_pool_grid(p, min(shape[1:]), where=f"{split}/manifest.json")


if __name__ == "__main__":
    stage_entry("pretrain", run)
