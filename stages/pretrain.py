"""DVC stage ``pretrain``: MoCo pretraining on the pretrain shards, export the query backbone.

Runs as a plain process or under ``torchrun --nproc_per_node N stages/pretrain.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params

# Resume state is not a DVC output (gitignored and dvcignored): a `persist: true` output would
# switch off DVC's run cache for the stage, and a `--queue`/`--temp` workspace is deleted after
# the run. It lives in the MAIN repo ($DVC_ROOT/.checkpoints/pretrain/<fingerprint>/last.pt,
# pipeline/train/resume_store.py), so a killed `dvc repro` and a killed queued or temp
# experiment, run again with the same params, both resume; a checkpoint with another
# fingerprint is never resumed.


def run(p: Params) -> None:
    import os
    from pathlib import Path

    from pipeline.data.checks import check_against_data
    from pipeline.data.index import index_location, pretrain_manifest
    from pipeline.data.manifest import read_manifest
    from pipeline.data.remote import shards_location
    from pipeline.signals import Terminated
    from pipeline.tracking import stage_run
    from pipeline.tracking.registry import publish_encoder
    from pipeline.train.checkpoint import resumable_run_id
    from pipeline.train.engine import pretrain
    from pipeline.train.resume_store import CHECKPOINT_NAME, open_entry, watch_workspace
    from pipeline.train.training_input import training_input

    rank = int(os.environ.get("RANK", "0"))
    shards = shards_location(p.data.shards_dir)  # a Path or a URL; both join with /
    # data.pretrain_shards is no dvc.yaml param here: only whether it is set matters, and the
    # index manifest (a dep) changes with that, not with a respelling of the same shards
    index = index_location("pretrain") if p.data.pretrain_shards else None
    pretrain_set = pretrain_manifest(shards, index, image_size=p.data.image_size)
    check_against_data(p, pretrain_set, shards / "pretrain")  # also the check_data stage's check
    # the one computation of what the training reads (params, image spec, data, code): the
    # resume key and the registry's recipe tags
    key = training_input(p, pretrain_set, int(os.environ.get("WORLD_SIZE", "1")))
    checkpoint_dir = open_entry(key.fingerprint, maintain=rank == 0)
    # a checkpoint the engine will resume names its MLflow run: continue it (one training = one run)
    resume = resumable_run_id(checkpoint_dir / CHECKPOINT_NAME, key) if rank == 0 else None
    with stage_run("pretrain", p, upstream=("build_shards", "index_shards"), rank=rank,
                   system_metrics=True, resume_run_id=resume) as mlrun, \
            watch_workspace() as watch:
        mlrun.log_shards(shards / "pretrain", context="training")
        if index is not None:
            mlrun.log_shards(index, context="training")
        try:
            pretrain(model=p.model, moco=p.moco, opt=p.pretrain, augment=p.augment,
                     seed=p.seed, shards_dir=shards, encoder_path=Path("models/encoder.pt"),
                     checkpoint_dir=checkpoint_dir, resume_key=key,
                     metrics_path=Path("metrics/pretrain.json"),
                     details_path=Path("eval/metrics/pretrain.json"),
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
        # the input example and preprocessing: the test images, or without labelled images
        # (data.source none) the built pretraining images, normalised as in training
        example = next((shards / s for s in ("test", "pretrain")
                        if read_manifest(shards / s).num_samples), shards / "test")
        publish_encoder(mlrun, params=p, training=key, encoder_path=Path("models/encoder.pt"),
                        example_split=example)  # logged model + registry version


if __name__ == "__main__":
    stage_entry("pretrain", run)
