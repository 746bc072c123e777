"""The monitor: what pretraining measures of the query backbone every few epochs.

With labels, the weighted kNN top-1/top-5 (:class:`KnnMonitor`); with or without them, the
label-free numbers (:class:`LabelFreeProbe`: RankMe, alignment, uniformity, view top-1).
:class:`Monitor` holds the two and the cadence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms as T
from torch import Tensor, nn

from pipeline.data.eval_loader import eval_loader
from pipeline.data.remote import ShardURL
from pipeline.data.views import BatchTwoCrop, build_batch_view
from pipeline.evaluate.features import extract_features
from pipeline.evaluate.knn import DEFAULT_K, DEFAULT_T, knn_classify
from pipeline.evaluate.labelfree import alignment, effective_rank, uniformity, view_top1
from pipeline.evaluate.verdict import Verdict, verdict

log = logging.getLogger(__name__)

VIEW_SEED = 20200  # the fixed seed of the label-free views (any constant: the same every time)


class KnnMonitor:
    """Weighted kNN (k=200, T=0.1) on L2-normalised features, BN in eval mode.

    The bank is the first ``n_train`` labelled train images and the queries the first
    ``n_test`` test images (manifest order), both through the evaluation transform. Features
    and the kNN vote are computed on the training device.

    Args:
        shards_dir: holds ``train/`` and ``test/``.
        transform: the evaluation transform (PIL → ``(C, H, W)`` float).
        device: the training device.
        n_train: bank size.
        n_test: number of queries.
        batch_size: feature-extraction batch size.
    """

    def __init__(self, shards_dir: Path, *, transform: Any, device: torch.device, n_train: int,
                 n_test: int, batch_size: int = 512) -> None:
        self.shards_dir, self.transform, self.device = shards_dir, transform, device
        self.n_train, self.n_test = n_train, n_test
        self.batch_size = batch_size

    def _features(self, backbone: nn.Module, split: str, n: int) -> Any:
        loader = eval_loader(self.shards_dir / split, transform=self.transform,
                             batch_size=self.batch_size, max_images=n)
        return extract_features(backbone, loader, device=self.device, progress=False)

    def __call__(self, backbone: nn.Module) -> dict[str, float]:
        """Top-1 and top-5 (%) of the backbone as it is now.

        Returns:
            ``{"knn_top1": ..., "knn_top5": ...}``.
        """
        t0 = time.time()
        train = self._features(backbone, "train", self.n_train)
        test = self._features(backbone, "test", self.n_test)
        res = knn_classify(train.features.to(self.device), train.labels.to(self.device),
                           test.features.to(self.device), test.labels.to(self.device),
                           k=DEFAULT_K, T=DEFAULT_T)  # the InstDisc protocol
        out = {"knn_top1": float(res.top1), "knn_top5": float(res.top5)}
        log.info("kNN monitor: top-1 %.2f%% top-5 %.2f%% (%.1fs)", out["knn_top1"],
                 out["knn_top5"], time.time() - t0)
        return out


def uint8_transform(image_size: int) -> T.Compose:
    """PIL image → ``(C, S, S)`` uint8: the evaluation resize and centre crop, no normalisation."""
    return T.Compose([T.Resize(image_size), T.CenterCrop(image_size), T.PILToTensor()])


class LabelFreeProbe:
    """RankMe, alignment, uniformity and view top-1 of a backbone on fixed pretraining images.

    Args:
        split: the built ``pretrain`` split (its first ``n`` images in manifest order).
        image_size: the training side S (images are resized and centre-cropped to it).
        mean: per-channel normalisation mean (the training one).
        std: per-channel normalisation std.
        preset: ``augment.preset`` (the two views are the training augmentation's).
        crop_min_scale: ``augment.crop_min_scale``.
        device: where the backbone runs.
        n: sample size (``pretrain.labelfree_images``); the split may hold fewer.
        batch_size: forward batch size.

    Raises:
        ShardError: the split cannot be read.
    """

    def __init__(self, split: Path | ShardURL, *, image_size: int, mean: Sequence[float],
                 std: Sequence[float], preset: str, crop_min_scale: float,
                 device: torch.device, n: int, batch_size: int = 512) -> None:
        loader = eval_loader(split, transform=uint8_transform(image_size), batch_size=512,
                             max_images=n)
        self.images = torch.cat([x for x, _, _ in loader])  # (N, C, S, S) uint8, CPU
        self.views = BatchTwoCrop(build_batch_view(preset, image_size, mean, std,
                                                   crop_min_scale, crop=True).to(device))
        self.mean = torch.tensor(list(mean), device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(list(std), device=device).view(1, -1, 1, 1)
        self.device, self.batch_size = device, batch_size

    def __len__(self) -> int:
        """N, the images in the sample."""
        return self.images.shape[0]

    @torch.no_grad()
    def _embed(self, backbone: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
        """``(plain, view 1, view 2)`` features, ``(N, D)`` float32 on CPU each."""
        plain, v1, v2 = [], [], []
        for i in range(0, len(self), self.batch_size):
            x = self.images[i:i + self.batch_size].to(self.device)
            q, k = self.views(x, VIEW_SEED + i)
            plain.append(backbone((x.float() / 255 - self.mean) / self.std).float().cpu())
            v1.append(backbone(q).float().cpu())
            v2.append(backbone(k).float().cpu())
        return torch.cat(plain), torch.cat(v1), torch.cat(v2)

    def __call__(self, backbone: nn.Module) -> dict[str, float]:
        """The numbers of ``backbone`` as it is now (eval mode; its mode is restored).

        Returns:
            ``{"rankme", "alignment", "uniformity", "view_top1"}``
            (:data:`pipeline.evaluate.labelfree.METRICS`).
        """
        t0 = time.time()
        was = [(m, m.training) for m in backbone.modules()]
        backbone.eval()
        try:
            plain, a, b = self._embed(backbone)
        finally:
            for m, training in was:
                m.training = training
        out = {"rankme": effective_rank(plain), "alignment": alignment(a, b),
               "uniformity": uniformity(plain), "view_top1": view_top1(a, b)}
        log.info("label-free (%d images): RankMe %.1f of %d, alignment %.3f, uniformity %.3f, "
                 "view top-1 %.2f%% (%.1fs)", len(self), out["rankme"], min(plain.shape),
                 out["alignment"], out["uniformity"], out["view_top1"], time.time() - t0)
        return out


@dataclass
class Monitor:
    """The monitor's parts and cadence (``pretrain.knn_every_epochs``).

    Attributes:
        every_epochs: run after every this many epochs (0 = never); epoch 0 = the random init.
        knn: the kNN part, None without labelled train and test images.
        labelfree: the label-free part, None when ``pretrain.labelfree_images`` is 0 or no
            built pretraining images exist.
        labelfree_off: why ``labelfree`` is (or would be) None, one clause naming the param.
    """

    every_epochs: int
    knn: KnnMonitor | None = None
    labelfree: LabelFreeProbe | None = None
    labelfree_off: str = ""

    def max_rank(self, num_features: int) -> int:
        """``min(N, D)`` of the label-free part: its images N, the feature width D (0: off)."""
        return min(len(self.labelfree), num_features) if self.labelfree is not None else 0

    def verdict(self, rows: list[dict[str, float]], num_features: int) -> Verdict | None:
        """The run's verdict from the label-free rows (:func:`pipeline.evaluate.verdict.verdict`).

        None without a label-free part or with too few rows (:meth:`no_verdict` says why).
        """
        if self.labelfree is None:
            return None
        return verdict(rows, self.max_rank(num_features), len(self.labelfree))

    def no_verdict(self) -> str:
        """Why :meth:`verdict` gave none, in one clause naming the param or the rows."""
        if self.labelfree is None:
            return self.labelfree_off
        return ("the label-free rows hold no random-init row and a later one (they are dropped "
                "when a checkpoint's monitor params differ)")

    def due(self, epoch: int, *, last: bool = False) -> bool:
        """Whether the monitor runs at the end of ``epoch``.

        Every ``every_epochs`` epochs, and after the last epoch (``last``) whatever the cadence:
        the end values are always end values.
        """
        return (self.every_epochs > 0 and (epoch % self.every_epochs == 0 or last)
                and (self.knn is not None or self.labelfree is not None))
