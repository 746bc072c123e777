"""The ``linear`` stage: the linear probe (MoCo protocol) in features or augment mode."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import write_json, write_tsv
from pipeline.config import FeatureNorm, LinearMode, LinearParams
from pipeline.data.eval_loader import eval_loader
from pipeline.data.loader import train_loader
from pipeline.data.remote import ShardURL
from pipeline.data.shards import image_spec, read_manifest
from pipeline.data.views import (
    BatchView,
    SeededRandomResizedCrop,
    build_eval_transform,
    flip_normalize,
)
from pipeline.errors import InputError
from pipeline.evaluate.features import load_features, pick_device
from pipeline.evaluate.heldout import split_train_val
from pipeline.evaluate.linear import train_linear_augment, train_linear_on_features
from pipeline.evaluate.run.embed import load_encoder
from pipeline.seeds import derive_seed

# MoCo's main_lincls.py: raw features (no normalisation), SGD lr 30 per 256 images, batch 256,
# weight decay 0, 100 epochs with x0.1 at epochs 60 and 80 (the schema's other linear defaults).
PROTOCOL = LinearParams(mode=LinearMode.features, feature_norm=FeatureNorm.none)
# metrics/linear.json (pipeline.atomic.headline); eval/metrics/linear.json holds every number
HEADLINE = ("top1", "val_top1", "wall_time_s")
VAL_PLOT = "linear_val.tsv"  # beside plots/linear.tsv (_write_history)


def linear_probe(*, features_dir: Path, shards_dir: Path | ShardURL, encoder_path: Path,
                 linear: LinearParams, seed: int, details_path: Path,
                 plots_path: Path, pool_grid: int = 1, layer: int = 4) -> dict[str, float]:
    """Linear probe (MoCo protocol); ``linear.mode`` picks precomputed features or augmentation.

    ``layer`` and ``pool_grid`` (``embed.layer``, ``embed.pool_grid``) are the feature layout of
    augment mode, which runs the backbone itself; features mode reads the embed stage's files,
    made with the same values.

    The reported top-1/top-5 are the FINAL epoch's on the test set. Labels as in
    :func:`knn_eval`: -1 ignored (logged), otherwise ``0..C-1`` with C from the test manifest.

    Always also ``protocol_top1``/``protocol_top5``: the MoCo linear protocol
    (:data:`PROTOCOL`: raw globally pooled backbone features ``{train,test}_global.pt``, lr 30
    per 256, 100 epochs, steps at 60/80), comparable with published numbers.
    """
    t0 = time.time()
    device = pick_device()
    names = list(read_manifest(shards_dir / "test").class_names)
    settings = dict(epochs=linear.epochs, batch_size=linear.batch_size, lr=linear.lr,
                    lr_schedule=linear.lr_schedule, milestones=linear.lr_milestones,
                    weight_decay=linear.weight_decay, feature_norm=linear.feature_norm,
                    seed=seed, device=device)
    if linear.mode == "features":
        train, test = (load_features(features_dir / f"{s}.pt") for s in ("train", "test"))
        res = train_linear_on_features(train, test, val_fraction=linear.val_fraction,
                                       num_classes=len(names), **settings)
    else:
        res = _linear_augment(shards_dir=shards_dir, encoder_path=encoder_path,
                              features_dir=features_dir, linear=linear, num_classes=len(names),
                              settings=settings, seed=seed, pool_grid=pool_grid,
                              layer=layer)
    write_json(details_path, res.details(names))
    _write_history(plots_path, res.history)
    out = {"top1": res.top1, "top5": res.top5, "epochs": linear.epochs, "lr": linear.lr,
           "lr_effective": res.lr_effective, "batch_size": linear.batch_size,
           "mode_augment": int(linear.mode == "augment"),
           "feature_norm_l2": int(linear.feature_norm == "l2"), "wall_time_s": time.time() - t0}
    if res.val_top1 is not None:
        out["val_top1"] = res.val_top1
    g_train, g_test = (load_features(features_dir / f"{s}_global.pt") for s in ("train", "test"))
    proto = train_linear_on_features(
        g_train, g_test, num_classes=len(names), epochs=PROTOCOL.epochs,
        batch_size=PROTOCOL.batch_size, lr=PROTOCOL.lr, lr_schedule=PROTOCOL.lr_schedule,
        milestones=PROTOCOL.lr_milestones, weight_decay=PROTOCOL.weight_decay,
        feature_norm=PROTOCOL.feature_norm, seed=seed, device=device)
    out.update(protocol_top1=proto.top1, protocol_top5=proto.top5)
    out["wall_time_s"] = time.time() - t0
    return out


# Loader worker processes of the augment-mode probe: they read, decode and crop; the frozen
# backbone runs in the stage's process. Fixed (not per machine), because the batch composition
# depends on the number of readers (see train_loader): the probe's result must not depend on
# the core count.
AUGMENT_NUM_WORKERS = 1
# The crop of the MoCo linear protocol: torchvision RandomResizedCrop defaults (main_lincls.py).
AUGMENT_CROP_SCALE = (0.08, 1.0)


def _linear_augment(*, shards_dir: Path | ShardURL, encoder_path: Path, features_dir: Path,
                    linear: LinearParams, num_classes: int, settings: dict[str, Any],
                    seed: int, pool_grid: int = 1, layer: int = 4) -> Any:
    """Augment mode: RandomResizedCrop + flip through the frozen backbone every step.

    Every epoch reads the TRAIN split in a new order (:func:`~pipeline.data.loader.train_loader`
    with ``(seed, epoch)``: shards permuted, a rotating offset, a shuffle buffer), in
    ``AUGMENT_NUM_WORKERS`` worker process(es) that decode and crop (scale
    ``AUGMENT_CROP_SCALE``, ratio 3/4-4/3, seeded by (seed, epoch, position)); the flip
    (p = 0.5, seeded by (seed, epoch, step)) and the normalisation run on the batch. Labels
    come from ``features_dir/train.pt`` by sample key. An epoch is ``N // batch_size`` loader
    batches, so fewer than one batch of images sits out each epoch (a different remainder every
    epoch); validation rows (``linear.val_fraction``, the split of features mode, cut from
    TRAIN) are dropped from the train batches and scored with the eval transform.
    """
    backbone, meta = load_encoder(encoder_path, pool_grid=pool_grid, layer=layer)
    backbone.to(settings.get("device", "cpu"))  # train_linear_augment's device (default cpu)
    m = read_manifest(shards_dir / "train")
    spec = image_spec(m, shards_dir / "train")
    size, mean, std = spec.size, spec.mean, spec.std
    test_tf = build_eval_transform(size, mean, std)
    feats = load_features(features_dir / "train.pt")
    n = m.num_samples
    if len(feats) != n:
        raise InputError(f"{features_dir / 'train.pt'} has {len(feats)} rows, "
                         f"{shards_dir / 'train'} has {n} samples: rerun the embed stage")
    label_of = dict(zip(feats.keys, feats.labels.tolist()))
    val_keys: set[str] = set()
    if linear.val_fraction > 0:
        _, val = split_train_val(n, linear.val_fraction, seed)
        val_keys = {feats.keys[i] for i in val.tolist()}
    crop = SeededRandomResizedCrop(size, scale=AUGMENT_CROP_SCALE)
    flip = BatchView(flip_normalize(mean, std))

    def train_batches(epoch: int) -> Any:
        loader = train_loader(shards_dir / "train", batch_size=linear.batch_size,
                              steps=n // linear.batch_size, epoch=epoch, seed=seed,
                              num_workers=AUGMENT_NUM_WORKERS, crop=crop, views=1)
        for step, (images, keys) in enumerate(loader):
            keep = [i for i, k in enumerate(keys) if k not in val_keys]
            if not keep:
                continue
            x = flip(images[keep, 0], derive_seed("probe-flip", seed, epoch, step))  # B x C x S x S
            y = torch.tensor([label_of[keys[i]] for i in keep], dtype=torch.long)
            yield x, y

    def batches(keep: Any) -> Any:
        for x, y, keys in eval_loader(shards_dir / "train", transform=test_tf,
                                      batch_size=linear.batch_size):
            rows = [i for i, k in enumerate(keys) if keep(k)]
            if rows:
                yield x[rows], y[rows]

    test = ((x, y) for x, y, _ in eval_loader(shards_dir / "test", transform=test_tf,
                                              batch_size=linear.batch_size))
    val = (lambda: batches(lambda k: k in val_keys)) if val_keys else None
    return train_linear_augment(backbone, train_batches, test, num_features=meta["num_features"],
                                num_classes=num_classes, val_batches=val, **settings)


def _write_history(path: Path, history: list[dict[str, float]]) -> None:
    """``plots/linear.tsv`` (epoch, loss, train_acc, lr, test_acc) and :data:`VAL_PLOT`.

    :data:`VAL_PLOT`, beside it: epoch, val_acc for the epochs with a validation score (a header
    alone without a validation split).

    The validation curve has its own file so that no column is ever empty: ``dvc plots show``
    draws an empty column as a line at 0, and a column named in ``dvc.yaml`` but missing from
    the file blanks the whole plot; a file with a header and no rows is not drawn at all.
    """
    rename = {"train_top1": "train_acc", "val_top1": "val_acc", "test_top1": "test_acc"}
    rows = [{rename.get(k, k): v for k, v in h.items()} for h in history]
    write_tsv(path, ["epoch", "loss", "train_acc", "lr", "test_acc"], rows)
    write_tsv(path.with_name(VAL_PLOT), ["epoch", "val_acc"], [r for r in rows if "val_acc" in r])
