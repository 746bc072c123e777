"""The ``baselines`` stage: what the MoCo features must beat (raw pixels, a random encoder)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from pipeline.config import LinearParams, ModelParams
from pipeline.data.eval_loader import eval_loader
from pipeline.data.remote import ShardURL
from pipeline.data.shards import image_spec, read_manifest
from pipeline.data.views import build_eval_transform
from pipeline.evaluate.features import FeatureSet, extract_features, pick_device
from pipeline.evaluate.knn import DEFAULT_K, DEFAULT_T, knn_classify, select_on_heldout
from pipeline.evaluate.linear import train_linear_on_features
from pipeline.evaluate.pooling import set_pool_grid
from pipeline.moco.backbones import build_backbone, resolve_small_stem, resolve_stem_stride

log = logging.getLogger(__name__)

# metrics/baselines.json (pipeline.atomic.headline): what MoCo's top-1s are compared with,
# under names short enough for one `dvc metrics show` line; eval/metrics/baselines.json
# holds every number under its full name
HEADLINE = {"pixels_knn": "raw_pixels_knn_tuned_top1", "pixels_linear": "raw_pixels_linear_top1",
            "random_knn": "random_encoder_top1", "wall_time_s": "wall_time_s"}


class Flatten(nn.Module):
    """Raw pixels as features: ``(B, C, H, W)`` normalised images -> ``(B, C*H*W)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Flatten every dimension but the batch."""
        return x.flatten(1)


def random_encoder(model: ModelParams, *, seed: int, image_size: int, in_channels: int,
                   layer: int, pool_grid: int) -> nn.Module:
    """The random-init encoder baseline: the backbone built after ``torch.manual_seed(seed)``.

    Pooled as the MoCo features are (stage ``layer``, ``pool_grid`` cells per side); BN keeps
    its initial running statistics. The same weights for every caller with the same params.
    """
    torch.manual_seed(seed)
    small = resolve_small_stem(model.small_stem, image_size)
    backbone = build_backbone(model.backbone, width=model.width, in_channels=in_channels,
                              small_stem=small,
                              stem_stride=resolve_stem_stride(model.stem_stride, small))
    set_pool_grid(backbone, pool_grid, layer)
    return backbone


def baselines(*, shards_dir: Path | ShardURL, model: ModelParams, seed: int,
              linear: LinearParams | None = None, batch_size: int = 512,
              pool_grid: int = 1, layer: int = 4) -> dict[str, float]:
    """What the MoCo features must beat: raw pixels (kNN, tuned kNN, linear) and a random encoder.

    * ``raw_pixels_*`` and ``random_encoder_*``: the reference kNN (k=200, T=0.1, InstDisc /
      MoCo CIFAR demo) on the normalised image flattened to ``(N, C*H*W)``, and on the backbone
      built with ``seed`` (BN in eval mode, initial running statistics; pooled as the MoCo
      features are: stage ``layer`` = ``embed.layer``, ``pool_grid`` = ``embed.pool_grid``).
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
    m = read_manifest(shards_dir / "train")
    spec = image_spec(m, shards_dir / "train")
    size, channels, num_classes = spec.size, spec.channels, len(m.class_names)
    tf = build_eval_transform(spec.size, spec.mean, spec.std)
    out: dict[str, float] = {}
    random_bb = random_encoder(model, seed=seed, image_size=size, in_channels=channels,
                               layer=layer, pool_grid=pool_grid).to(device)
    for name, net in (("raw_pixels", Flatten()), ("random_encoder", random_bb)):
        t0 = time.time()
        tr, te = (extract_features(net, eval_loader(shards_dir / s, transform=tf,
                                                    batch_size=batch_size),
                                   device=device, desc=f"{name} {s}",
                                   rows=read_manifest(shards_dir / s).num_samples)  # one (N, D)
                  for s in ("train", "test"))
        res = knn_classify(tr.features, tr.labels, te.features, te.labels, k=DEFAULT_K,
                           T=DEFAULT_T, num_classes=num_classes, device=device)
        out[f"{name}_top1"], out[f"{name}_top5"] = res.top1, res.top5
        log.info("baseline %s: kNN top-1 %.2f%% (%.1fs)", name, res.top1, time.time() - t0)
        if name == "raw_pixels":
            out.update(_pixel_baselines(tr, te, num_classes=num_classes, seed=seed,
                                        linear=linear, device=device))
        del tr, te  # one network's features in memory at a time
    out["k"], out["T"] = DEFAULT_K, DEFAULT_T
    out["wall_time_s"] = time.time() - t_start
    return out


def _pixel_baselines(train: FeatureSet, test: FeatureSet, *, num_classes: int, seed: int,
                     linear: LinearParams | None, device: torch.device) -> dict[str, float]:
    """The tuned kNN and the linear probe on raw-pixel features (see :func:`baselines`)."""
    t0 = time.time()
    sel, n_val = select_on_heldout(train.features, train.labels, seed=seed, device=device)
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
