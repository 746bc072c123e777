"""The evaluation stages' work: embed, baselines, kNN and the linear probe.

Each function takes typed keyword arguments, reads its inputs, writes its outputs atomically
and returns the metrics it wrote (numeric leaves only). The DVC stage scripts call exactly one
of them.

Labels: the number of classes is the manifest's ``class_names``; a label outside
``0..C-1`` is refused, naming the value, and rows labelled -1 (unlabelled) are ignored with a
logged count (the rule of :mod:`pipeline.evaluate.metrics`).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.atomic import write_json as write_json_atomic
from pipeline.atomic import write_tsv
from pipeline.config import KnnParams, LinearParams, ModelParams
from pipeline.data.augment import build_eval_transform
from pipeline.data.crop import RandomResizedCrop
from pipeline.data.loader import eval_loader, read_manifest, train_loader
from pipeline.data.remote import ShardURL
from pipeline.evaluate.features import FeatureSet, extract_features, load_features, save_features
from pipeline.evaluate.knn import (
    DEFAULT_K,
    DEFAULT_T,
    KnnSelection,
    knn_classify,
    select_k_T,
)
from pipeline.evaluate.linear import (
    split_train_val,
    train_linear_augment,
    train_linear_on_features,
)
from pipeline.evaluate.metrics import ClassificationMetrics
from pipeline.evaluate.pooling import set_pool_grid
from pipeline.moco.backbones import (
    build_backbone,
    build_head,
    resolve_small_stem,
    resolve_stem_stride,
)

log = logging.getLogger(__name__)

# Share of TRAIN held out to choose a kNN's k and T (the split of split_train_val): the tuned
# raw-pixel baseline always, the MoCo kNN with knn.select = val. Same seed, same split.
KNN_SELECT_VAL_FRACTION = 0.1


def pick_device() -> torch.device:
    """CUDA when available, else CPU (chosen once per stage)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _spec(split_dir: Path | ShardURL) -> tuple[dict[str, Any], int, tuple, tuple]:
    """(manifest, evaluation image size, mean, std) of a split.

    Square shards of one size evaluate at that size. Shards built with ``data.max_side`` keep
    whole images of varying size; they evaluate at the build's ``image_size`` (for 224: resize
    the shorter side to 256, centre-crop 224, once, see ``build_eval_transform``).
    """
    m = read_manifest(split_dir)
    shape = m.get("image_shape")
    build = m.get("build") or {}
    if not shape:
        if build.get("max_side") and build.get("image_size"):
            return m, int(build["image_size"]), tuple(m["mean"]), tuple(m["std"])
        raise ValueError(f"{split_dir}/manifest.json: mixed image sizes; set data.image_size")
    return m, int(shape[1]), tuple(m["mean"]), tuple(m["std"])


def load_encoder(encoder_path: Path, *, pool_grid: int = 1) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the exported backbone from ``encoder.pt`` + ``encoder.json``.

    Args:
        encoder_path: ``models/encoder.pt`` (its ``.json`` sidecar next to it).
        pool_grid: ``embed.pool_grid``: the last stage average-pooled to ``g x g`` cells and
            flattened (see :class:`~pipeline.moco.backbones.GridPool`); 1 = global pooling.

    Returns:
        (backbone with ``fc = Identity`` giving ``(N, num_features)`` features, metadata whose
        ``num_features`` is that width: ``C * pool_grid**2``).

    Raises:
        FileNotFoundError: a file is missing.
        RuntimeError: the weights do not fit the recorded architecture (anything but ``fc.*``
            missing, or unexpected keys).
        ValueError: ``pool_grid < 1``.
    """
    import json

    meta = json.loads(Path(encoder_path).with_suffix(".json").read_text())
    backbone = build_backbone(meta["backbone"], width=meta["width"],
                              in_channels=meta["in_channels"], small_stem=meta["small_stem"],
                              stem_stride=meta.get("stem_stride", 1))
    sd = torch.load(encoder_path, map_location="cpu", weights_only=True)
    missing, unexpected = backbone.load_state_dict(sd, strict=False)
    if unexpected or any(not k.startswith("fc.") for k in missing):
        raise RuntimeError(f"{encoder_path} does not fit {meta['backbone']} width "
                           f"{meta['width']}: missing {missing}, unexpected {unexpected}")
    meta = {**meta, "num_features": set_pool_grid(backbone, pool_grid), "pool_grid": pool_grid}
    return backbone, meta


def embed(*, encoder_path: Path, shards_dir: Path | ShardURL, out_dir: Path, batch_size: int,
          use_head: bool = False, head_path: Path | None = None,
          num_workers: int = 0, pool_grid: int = 1) -> dict[str, float]:
    """Frozen features of the labelled train and test shards (eval transform, BN in eval mode).

    The features are the backbone's last stage average-pooled to ``pool_grid x pool_grid``
    cells and flattened (``embed.pool_grid``; 1 = global average pooling, the MoCo protocol),
    or, with ``use_head``, the projection head's output on the globally pooled features.

    Writes ``out_dir/train.pt`` and ``out_dir/test.pt`` (``FeatureSet``: (N, D) float32,
    (N,) labels, keys).

    Returns:
        ``{split}_images``, ``{split}_images_per_s`` (extraction only), ``dim`` (D),
        ``images_per_s`` (both splits, extraction only), ``pool_grid`` and ``wall_time_s``
        (seconds, from loading the encoder to the saved features).

    Raises:
        FileNotFoundError: the encoder or the shards are missing.
        ValueError: ``pool_grid`` > 1 with ``use_head`` (the head takes ``(N, C)`` pooled
            features), or larger than the last stage's map (nothing is written then).
    """
    t_start = time.time()
    if use_head and pool_grid != 1:
        raise ValueError(f"embed.pool_grid = {pool_grid} with embed.use_head: the projection "
                         "head takes globally pooled features; set embed.pool_grid: 1")
    device = pick_device()
    backbone, _ = load_encoder(encoder_path, pool_grid=pool_grid)
    head = None
    if use_head:
        if head_path is None or not Path(head_path).is_file():
            raise FileNotFoundError(f"embed.use_head is true but {head_path} is missing")
        head = torch.load(head_path, map_location="cpu", weights_only=True)
        head = _load_head(head)
    metrics: dict[str, float] = {"pool_grid": pool_grid}
    done: dict[str, FeatureSet] = {}
    embed_s: dict[str, float] = {}
    for split in ("train", "test"):
        m, size, mean, std = _spec(shards_dir / split)
        t0 = time.time()
        fs = extract_features(backbone, eval_loader(
            shards_dir / split, transform=build_eval_transform(size, mean, std),
            batch_size=batch_size, num_workers=num_workers), device=device, head=head,
            desc=f"embed {split}", progress=sys.stderr.isatty())
        dt = embed_s[split] = time.time() - t0
        done[split] = fs
        metrics[f"{split}_images"] = len(fs)
        metrics[f"{split}_images_per_s"] = len(fs) / max(dt, 1e-9)
        metrics["dim"] = fs.features.shape[1]
        log.info("embedded %d %s images in %.1fs", len(fs), split, dt)
    # written only once both splits are embedded: a failure leaves the previous pair intact
    for split, fs in done.items():
        save_features(fs, out_dir / f"{split}.pt")
    n_images = sum(len(fs) for fs in done.values())
    metrics["images_per_s"] = n_images / max(sum(embed_s.values()), 1e-9)
    metrics["wall_time_s"] = time.time() - t_start
    return metrics


def _load_head(payload: dict[str, Any]) -> nn.Module:
    head = build_head(payload["kind"], payload["in_dim"], payload["hidden"], payload["dim"])
    head.load_state_dict(payload["state_dict"])
    return head


def _details(res: ClassificationMetrics, class_names: list[str]) -> dict[str, Any]:
    """Per-class accuracy and confusion matrix in class-name order (for the report)."""
    idx = {c: i for i, c in enumerate(res.classes)}
    per_class = [res.per_class_accuracy.get(i) for i in range(len(class_names))]
    n = len(class_names)
    conf = [[0] * n for _ in range(n)]
    for a, ra in idx.items():
        for b, rb in idx.items():
            if 0 <= a < n and 0 <= b < n:
                conf[a][b] = int(res.confusion[ra][rb])
    return {"class_names": class_names, "per_class_accuracy": per_class, "confusion_matrix": conf}


def _select_on_train(train: FeatureSet, *, seed: int, device: torch.device,
                     chunk_size: int = 1024) -> tuple[KnnSelection, int]:
    """Choose k and T on ``KNN_SELECT_VAL_FRACTION`` of ``train`` (seeded split), the rest as bank.

    The one selection protocol of the tuned raw-pixel kNN and of ``knn.select: val``.
    Returns the selection and the number of held-out rows.
    """
    tr, va = split_train_val(len(train), KNN_SELECT_VAL_FRACTION, seed)
    sel = select_k_T(train.features[tr], train.labels[tr], train.features[va], train.labels[va],
                     chunk_size=chunk_size, device=device)
    return sel, len(va)


def knn_eval(*, features_dir: Path, manifest_dir: Path | ShardURL, knn: KnnParams,
             details_path: Path, seed: int = 0) -> dict[str, float]:
    """Weighted kNN of test features against the train bank (InstDisc protocol).

    Rows labelled -1 are ignored (logged); other labels must lie in ``0..C-1``, C = the number
    of class names in the manifest of ``manifest_dir``.

    With ``knn.select == "val"``, ``k`` and ``T`` are not taken from the params but chosen on
    a validation split of TRAIN exactly as for the tuned raw-pixel kNN of :func:`baselines`
    (``KNN_SELECT_VAL_FRACTION`` of train, seeded by ``seed``, the grid of
    :func:`~pipeline.evaluate.knn.select_k_T`), so MoCo and pixels get the same protocol; the
    test score then uses the whole train bank with the chosen values. The test set never
    chooses anything.

    With ``knn.val_fraction > 0`` it also scores a validation split of TRAIN (the split of
    :func:`~pipeline.evaluate.linear.split_train_val` with ``seed``, the linear probe's split):
    the held-out train rows are the queries and the rest of train is the bank. This is the
    number to select recipes on; the test score always uses the whole train bank.

    Returns:
        ``top1``, ``top5`` (%), ``val_top1`` (% , only with a validation split), the protocol
        values ``k``, ``T`` (the chosen ones with ``select: val``, then also ``select_val`` = 1
        and ``select_val_top1``, the best validation top-1 of the grid, %), sizes (all rows of
        the feature files) and wall time (s).

    Raises:
        ValueError: a label outside ``0..C-1`` other than -1 (named).
    """
    t0 = time.time()
    train, test = load_features(features_dir / "train.pt"), load_features(features_dir / "test.pt")
    names = read_manifest(manifest_dir)["class_names"]
    device = pick_device()
    k, T, out = knn.k, knn.T, {}
    if knn.select == "val":
        sel, n_val = _select_on_train(train, seed=seed, device=device, chunk_size=knn.chunk_size)
        k, T = sel.k, sel.T
        out.update(select_val=1, select_val_top1=sel.val_top1)
        log.info("kNN: k=%d T=%g chosen on %d held-out train images (val top-1 %.2f%%)",
                 k, T, n_val, sel.val_top1)
    kw = dict(k=k, T=T, num_classes=len(names), chunk_size=knn.chunk_size, device=device)
    res = knn_classify(train.features, train.labels, test.features, test.labels, **kw)
    write_json_atomic(details_path, _details(res, names))
    out.update({"top1": res.top1, "top5": res.top5, "k": k, "T": T,
                "num_train": len(train), "num_test": len(test)})
    if knn.val_fraction > 0:
        tr, va = split_train_val(len(train), knn.val_fraction, seed)
        val = knn_classify(train.features[tr], train.labels[tr], train.features[va],
                           train.labels[va], **kw)
        out.update(val_top1=val.top1, num_val=len(va))
        log.info("kNN validation (%d train rows held out of the bank): top-1 %.2f%%",
                 len(va), val.top1)
    out["wall_time_s"] = time.time() - t0
    return out


def baselines(*, shards_dir: Path | ShardURL, model: ModelParams, seed: int,
              linear: LinearParams | None = None, batch_size: int = 512,
              pool_grid: int = 1) -> dict[str, float]:
    """What the MoCo features must beat: raw pixels (kNN, tuned kNN, linear) and a random encoder.

    * ``raw_pixels_*`` and ``random_encoder_*``: the reference kNN (k=200, T=0.1, InstDisc /
      MoCo CIFAR demo) on the normalised image flattened to ``(N, C*H*W)``, and on the backbone
      built with ``seed`` (BN in eval mode, initial running statistics; its last stage pooled
      as the MoCo features are, ``pool_grid`` = ``embed.pool_grid``).
    * ``raw_pixels_knn_tuned_*``: kNN on raw pixels with k and T chosen on a validation split
      of TRAIN (``KNN_SELECT_VAL_FRACTION`` of it, seeded by ``seed``; the grid of
      :func:`~pipeline.evaluate.knn.select_k_T`), then scored on test with the whole train bank.
      The test set never chooses anything.
    * ``raw_pixels_linear_*`` (when ``linear`` is given): the linear probe of the ``linear``
      params, same code and protocol as the MoCo probe, on raw-pixel features (always the
      ``features`` mode: there is no backbone to augment through).

    Labels as in :func:`knn_eval` (-1 ignored, ``0..C-1`` otherwise).
    """
    t_start = time.time()
    device = pick_device()
    m, size, mean, std = _spec(shards_dir / "train")
    channels = int(m["image_shape"][0])
    num_classes = len(m["class_names"])
    tf = build_eval_transform(size, mean, std)
    out: dict[str, float] = {}

    class Flatten(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.flatten(1)

    torch.manual_seed(seed)
    small = resolve_small_stem(model.small_stem, size)
    random_bb = build_backbone(model.backbone, width=model.width, in_channels=channels,
                               small_stem=small,
                               stem_stride=resolve_stem_stride(model.stem_stride, small))
    set_pool_grid(random_bb, pool_grid)
    for name, net in (("raw_pixels", Flatten()), ("random_encoder", random_bb)):
        t0 = time.time()
        tr, te = (extract_features(net, eval_loader(shards_dir / s, transform=tf,
                                                    batch_size=batch_size),
                                   device=device, desc=f"{name} {s}",
                                   progress=sys.stderr.isatty()) for s in ("train", "test"))
        res = knn_classify(tr.features, tr.labels, te.features, te.labels, k=DEFAULT_K,
                           T=DEFAULT_T, num_classes=num_classes, device=device)
        out[f"{name}_top1"], out[f"{name}_top5"] = res.top1, res.top5
        log.info("baseline %s: kNN top-1 %.2f%% (%.1fs)", name, res.top1, time.time() - t0)
        if name == "raw_pixels":
            out.update(_pixel_baselines(tr, te, num_classes=num_classes, seed=seed,
                                        linear=linear, device=device))
    out["k"], out["T"] = DEFAULT_K, DEFAULT_T
    out["wall_time_s"] = time.time() - t_start
    return out


def _pixel_baselines(train: FeatureSet, test: FeatureSet, *, num_classes: int, seed: int,
                     linear: LinearParams | None, device: torch.device) -> dict[str, float]:
    """The tuned kNN and the linear probe on raw-pixel features (see :func:`baselines`)."""
    t0 = time.time()
    sel, n_val = _select_on_train(train, seed=seed, device=device)
    res = knn_classify(train.features, train.labels, test.features, test.labels, k=sel.k,
                       T=sel.T, num_classes=num_classes, device=device)
    out = {"raw_pixels_knn_tuned_top1": res.top1, "raw_pixels_knn_tuned_top5": res.top5,
           "raw_pixels_knn_tuned_k": sel.k, "raw_pixels_knn_tuned_T": sel.T,
           "raw_pixels_knn_tuned_val_top1": sel.val_top1}
    log.info("baseline raw pixels, kNN with k=%d T=%g chosen on %d held-out train images "
             "(val top-1 %.2f%%): test top-1 %.2f%% (%.1fs)", sel.k, sel.T, n_val,
             sel.val_top1, res.top1, time.time() - t0)
    if linear is not None:
        t0 = time.time()
        lin = train_linear_on_features(
            train, test, val_fraction=linear.val_fraction, num_classes=num_classes,
            epochs=linear.epochs, batch_size=linear.batch_size, lr=linear.lr,
            lr_schedule=linear.lr_schedule, milestones=linear.lr_milestones,
            weight_decay=linear.weight_decay, feature_norm=linear.feature_norm, seed=seed,
            device=device)
        out["raw_pixels_linear_top1"], out["raw_pixels_linear_top5"] = lin.top1, lin.top5
        if lin.val_top1 is not None:
            out["raw_pixels_linear_val_top1"] = lin.val_top1
        log.info("baseline raw pixels, linear probe: top-1 %.2f%% (%.1fs)", lin.top1,
                 time.time() - t0)
    return out


def linear_probe(*, features_dir: Path, shards_dir: Path | ShardURL, encoder_path: Path,
                 linear: LinearParams, seed: int, details_path: Path,
                 plots_path: Path, pool_grid: int = 1) -> dict[str, float]:
    """Linear probe (MoCo protocol); ``linear.mode`` picks precomputed features or augmentation.

    ``pool_grid`` (``embed.pool_grid``) is the feature layout of augment mode, which runs the
    backbone itself; features mode reads the embed stage's files, made with the same value.

    The reported top-1/top-5 are the FINAL epoch's on the test set. Labels as in
    :func:`knn_eval`: -1 ignored (logged), otherwise ``0..C-1`` with C from the test manifest.
    """
    t0 = time.time()
    device = pick_device()
    names = read_manifest(shards_dir / "test")["class_names"]
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
                              settings=settings, seed=seed, pool_grid=pool_grid)
    write_json_atomic(details_path, _details(res, names))
    _write_history(plots_path, res.history)
    out = {"top1": res.top1, "top5": res.top5, "epochs": linear.epochs, "lr": linear.lr,
           "lr_effective": res.lr_effective, "batch_size": linear.batch_size,
           "mode_augment": int(linear.mode == "augment"),
           "feature_norm_l2": int(linear.feature_norm == "l2"), "wall_time_s": time.time() - t0}
    if res.val_top1 is not None:
        out["val_top1"] = res.val_top1
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
                    seed: int, pool_grid: int = 1) -> Any:
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
    backbone, meta = load_encoder(encoder_path, pool_grid=pool_grid)
    m, size, mean, std = _spec(shards_dir / "train")
    test_tf = build_eval_transform(size, mean, std)
    feats = load_features(features_dir / "train.pt")
    n = int(m["num_samples"])
    if len(feats) != n:
        raise ValueError(f"{features_dir / 'train.pt'} has {len(feats)} rows, "
                         f"{shards_dir / 'train'} has {n} samples: rerun the embed stage")
    label_of = dict(zip(feats.keys, feats.labels.tolist()))
    val_keys: set[str] = set()
    if linear.val_fraction > 0:
        _, val = split_train_val(n, linear.val_fraction, seed)
        val_keys = {feats.keys[i] for i in val.tolist()}
    crop = RandomResizedCrop(size, scale=AUGMENT_CROP_SCALE)
    mean_t = torch.tensor(mean).view(1, -1, 1, 1)
    std_t = torch.tensor(std).view(1, -1, 1, 1)

    def train_batches(epoch: int) -> Any:
        loader = train_loader(shards_dir / "train", batch_size=linear.batch_size,
                              steps=n // linear.batch_size, epoch=epoch, seed=seed,
                              num_workers=AUGMENT_NUM_WORKERS, crop=crop, views=1)
        for step, (images, keys) in enumerate(loader):
            keep = [i for i, k in enumerate(keys) if k not in val_keys]
            if not keep:
                continue
            x = images[keep, 0].float().div_(255.0)  # B x C x S x S in [0, 1]
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 10_007 + step)
            flip = torch.rand(len(keep), generator=g) < 0.5
            x[flip] = x[flip].flip(-1)
            y = torch.tensor([label_of[keys[i]] for i in keep], dtype=torch.long)
            yield (x - mean_t) / std_t, y

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
    """``plots/linear.tsv``: epoch, loss, train_acc, lr (+ val_acc, test_acc when known)."""
    rename = {"train_top1": "train_acc", "val_top1": "val_acc", "test_top1": "test_acc"}
    rows = [{rename.get(k, k): v for k, v in h.items()} for h in history]
    write_tsv(path, ["epoch", "loss", "train_acc", "lr", "val_acc", "test_acc"], rows)


__all__ = ["FeatureSet", "baselines", "embed", "knn_eval", "linear_probe", "load_encoder"]
