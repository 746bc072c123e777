"""Quality without labels: effective rank (RankMe), alignment and uniformity of an encoder.

For a user whose images nobody labelled, three numbers computed from images alone:

* **RankMe** (Garrido et al., ICML 2023): the effective rank of the ``(N, D)`` embedding matrix,
  ``exp(-sum_k p_k log p_k)`` with ``p_k = s_k / sum(s) + eps`` over its singular values ``s``.
  It reaches ``min(N, D)`` when every direction carries the same energy and falls toward 1 as
  the embeddings collapse onto fewer directions; Garrido et al. found it tracks downstream
  accuracy across SSL runs.
* **Alignment** (Wang & Isola, ICML 2020): the mean squared distance between the L2-normalised
  embeddings of two augmented views of one image, ``E ||f(x) - f(x')||^2`` (``alpha = 2``), in
  ``[0, 4]``; lower = views of one image land closer.
* **Uniformity** (Wang & Isola): ``log E exp(-t ||f(x) - f(y)||^2)`` over pairs of different
  images (``t = 2``), in ``[-4, 0]``; lower = the images spread more evenly over the sphere.

All three are computed on the backbone's globally pooled features (what a user gets from
``models/encoder.pt``), in fp64 for the reductions, on a fixed sample of pretraining images:
the first ``n`` of the built ``pretrain`` split in manifest order (itself a seeded shuffle of
the source), resized and centre-cropped to the training side. The two views are the training
augmentation's (:func:`pipeline.data.views.build_batch_view`) under a fixed seed, so the same
encoder always gets the same numbers. :class:`LabelFreeProbe` runs them at every kNN-monitor
point and at the end of pretraining, also without labels (``data.source: none``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torchvision.transforms as T
from torch import Tensor, nn

from pipeline.data.loader import eval_loader
from pipeline.data.remote import ShardURL
from pipeline.data.views import BatchTwoCrop, build_batch_view
from pipeline.evaluate.normalize import l2_normalize

log = logging.getLogger(__name__)

RANKME_EPS = 1e-7  # Garrido et al. 2023, the epsilon added to each normalised singular value
ALIGN_ALPHA = 2  # Wang & Isola 2020, the default exponent of the alignment loss
UNIFORM_T = 2.0  # Wang & Isola 2020, the default temperature of the uniformity loss
VIEW_SEED = 20200   # the fixed seed of the two views (any constant: the same views every time)
METRICS = ("rankme", "alignment", "uniformity")


def effective_rank(features: Tensor, eps: float = RANKME_EPS) -> float:
    """RankMe of an ``(N, D)`` embedding matrix (see the module docstring).

    Args:
        features: ``(N, D)`` embeddings, any float dtype (computed in fp64).
        eps: added to each normalised singular value (Garrido et al.: 1e-7).

    Returns:
        A number in ``[1, min(N, D)]`` (up to ``eps``).

    Raises:
        ValueError: ``features`` is not 2-D with at least one row, or holds a NaN/inf.
    """
    if features.ndim != 2 or features.shape[0] < 1:
        raise ValueError(f"effective_rank: expected (N, D) features, got {tuple(features.shape)}")
    if not bool(torch.isfinite(features).all()):
        raise ValueError("effective_rank: the features hold a NaN or an infinity")
    s = torch.linalg.svdvals(features.double())  # (min(N, D),)
    if float(s.sum()) == 0.0:
        return 1.0
    p = s / s.sum() + eps
    return float(torch.exp(-(p * torch.log(p)).sum()))


def alignment(a: Tensor, b: Tensor, alpha: int = ALIGN_ALPHA) -> float:
    """``E ||a_i - b_i||^alpha`` over L2-normalised rows: views ``a`` and ``b`` of one image each.

    Args:
        a: ``(N, D)`` embeddings of the first views.
        b: ``(N, D)`` embeddings of the second views, row ``i`` of the same image as ``a[i]``.
        alpha: the exponent (Wang & Isola: 2).

    Returns:
        A number in ``[0, 2**alpha]``.

    Raises:
        ValueError: shapes differ or are not ``(N, D)`` with N >= 1.
    """
    if a.shape != b.shape or a.ndim != 2 or a.shape[0] < 1:
        raise ValueError(f"alignment: expected two (N, D) tensors of one shape, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    za, zb = l2_normalize(a.double()), l2_normalize(b.double())
    return float((za - zb).norm(dim=1).pow(alpha).mean())


def uniformity(features: Tensor, t: float = UNIFORM_T) -> float:
    """``log E exp(-t ||z_i - z_j||^2)`` over the pairs ``i < j`` of L2-normalised rows.

    Args:
        features: ``(N, D)`` embeddings, N >= 2.
        t: the temperature (Wang & Isola: 2).

    Returns:
        A number in ``[-4 t, 0]`` (``-4 t`` only for antipodal pairs).

    Raises:
        ValueError: fewer than two rows.
    """
    if features.ndim != 2 or features.shape[0] < 2:
        raise ValueError(f"uniformity: expected (N, D) features with N >= 2, got "
                         f"{tuple(features.shape)}")
    z = l2_normalize(features.double())
    sq = torch.pdist(z).pow(2)  # (N (N - 1) / 2,) squared distances of the pairs i < j
    return float(torch.logsumexp(-t * sq, dim=0) - math.log(sq.numel()))


def uint8_transform(image_size: int) -> T.Compose:
    """PIL image → ``(C, S, S)`` uint8: the evaluation resize and centre crop, no normalisation."""
    return T.Compose([T.Resize(image_size), T.CenterCrop(image_size), T.PILToTensor()])


class LabelFreeProbe:
    """RankMe, alignment and uniformity of a backbone on a fixed sample of pretraining images.

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
        """The three numbers of ``backbone`` as it is now (eval mode; its mode is restored).

        Returns:
            ``{"rankme", "alignment", "uniformity"}``.
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
               "uniformity": uniformity(plain)}
        log.info("label-free (%d images): RankMe %.1f of %d, alignment %.3f, uniformity %.3f "
                 "(%.1fs)", len(self), out["rankme"], min(plain.shape), out["alignment"],
                 out["uniformity"], time.time() - t0)
        return out
