"""The monitor: what pretraining measures of the query backbone every few epochs.

With labels, the weighted kNN top-1/top-5 (:class:`KnnMonitor`); with or without them, the
label-free numbers (:class:`pipeline.evaluate.labelfree.LabelFreeProbe`: RankMe, alignment,
uniformity). :class:`Monitor` holds the two and the cadence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.data.loader import eval_loader
from pipeline.evaluate.features import extract_features
from pipeline.evaluate.knn import knn_classify
from pipeline.evaluate.labelfree import LabelFreeProbe

log = logging.getLogger(__name__)

MONITOR_K, MONITOR_T = 200, 0.1  # InstDisc / MoCo CIFAR-10 demo


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
                           k=MONITOR_K, T=MONITOR_T)
        out = {"knn_top1": float(res.top1), "knn_top5": float(res.top5)}
        log.info("kNN monitor: top-1 %.2f%% top-5 %.2f%% (%.1fs)", out["knn_top1"],
                 out["knn_top5"], time.time() - t0)
        return out


@dataclass
class Monitor:
    """The monitor's parts and cadence (``pretrain.knn_every_epochs``).

    Attributes:
        every_epochs: run after every this many epochs (0 = never); epoch 0 = the random init.
        knn: the kNN part, None without labelled train and test images.
        labelfree: the label-free part, None when ``pretrain.labelfree_images`` is 0 or no
            built pretraining images exist.
    """

    every_epochs: int
    knn: KnnMonitor | None = None
    labelfree: LabelFreeProbe | None = None

    def due(self, epoch: int) -> bool:
        """Whether the monitor runs at the end of ``epoch``."""
        return (self.every_epochs > 0 and epoch % self.every_epochs == 0
                and (self.knn is not None or self.labelfree is not None))
