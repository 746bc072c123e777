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

# Resume state is not a DVC output (gitignored and dvcignored): a `persist: true` output would
# switch off DVC's run cache for the stage, and a `--queue`/`--temp` workspace is deleted after
# the run. It lives in the MAIN repo ($DVC_ROOT/.checkpoints/pretrain/<fingerprint>/last.pt,
# pipeline/train/resume_store.py), so a killed `dvc repro` and a killed queued or temp
# experiment, run again with the same params, both resume; a checkpoint with another
# fingerprint is never resumed.


def run(p: Params) -> None:
    import os
    from pathlib import Path

    from pipeline.data.index import index_location, pretrain_manifest
    from pipeline.data.remote import shards_location
    from pipeline.model_registry import publish_encoder
    from pipeline.signals import Terminated
    from pipeline.tracking import stage_run
    from pipeline.train.engine import pretrain
    from pipeline.train.resume import resumable_run_id
    from pipeline.train.resume_store import CHECKPOINT_NAME, entry_dir, open_entry, watch_workspace

    rank = int(os.environ.get("RANK", "0"))
    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    index = index_location("pretrain") if p.data.pretrain_shards else None
    pretrain_set = pretrain_manifest(shards, index, image_size=p.data.image_size)
    check_before_training(p, pretrain_set, shards / "pretrain")
    # a checkpoint the engine will resume names its MLflow run: continue it (one training = one run)
    resume = resumable_run_id(
        lambda fp: entry_dir(fp) / CHECKPOINT_NAME, seed=p.seed, model=p.model, moco=p.moco,
        augment=p.augment, opt=p.pretrain, pretrain_set=pretrain_set,
        world_size=int(os.environ.get("WORLD_SIZE", "1"))) if rank == 0 else None
    with stage_run("pretrain", p, upstream=("build_shards", "index_shards"), rank=rank,
                   system_metrics=True, resume_run_id=resume) as mlrun, \
            watch_workspace() as watch:
        mlrun.log_shards(shards / "pretrain", context="training")
        if index is not None:
            mlrun.log_shards(index, context="training")
        try:
            pretrain(model=p.model, moco=p.moco, opt=p.pretrain, augment=p.augment,
                     seed=p.seed, shards_dir=shards, encoder_path=Path("models/encoder.pt"),
                     checkpoint_dir=lambda fp: open_entry(fp, maintain=rank == 0),
                     metrics_path=Path("metrics/pretrain.json"),
                     plots_path=Path("plots/pretrain.tsv"),
                     knn_plots_path=Path("plots/knn_monitor.tsv"), run=mlrun,
                     pretrain_set=pretrain_set, abandoned=watch.abandoned)
        except Terminated as e:  # stopped by the workspace watch: say why
            if watch.reason is None:
                raise
            raise Terminated(f"{e}; {watch.reason}", signum=e.signum) from None
        for f in ("metrics/pretrain.json", "plots/pretrain.tsv", "plots/knn_monitor.tsv",
                  "models/encoder.json", "models/encoder.safetensors"):
            mlrun.log_artifact(f)
        publish_encoder(mlrun, params=p, encoder_path=Path("models/encoder.pt"),
                        example_split=shards / "test")  # logged model + registry version


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
