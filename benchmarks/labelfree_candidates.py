"""Candidate label-free numbers beyond RankMe/alignment/uniformity, for the verdict study.

Every number is computed on the globally pooled backbone features (what the monitor uses) of
the first images of the built ``pretrain`` split, and the views are the training
augmentation's under fixed seeds (as :class:`pipeline.train.monitor.LabelFreeProbe`):

* ``rankme_2048`` / ``rankme_25600``: RankMe on 2,048 (the monitor's) and 25,600 images
  (Garrido et al. use 25,600).
* ``alignment``, ``uniformity``: as the monitor (2,048 images).
* ``view_top1_N``: label-free view retrieval (:func:`pipeline.evaluate.labelfree.view_top1`):
  two views of N images; the share of first views whose nearest second view (cosine) is the
  same image's (both directions averaged). Chance is 1/N; a constant encoder gets it.
* ``lidar``: LiDAR (Thilak et al., ICLR 2024): the effective rank of the linear discriminant
  matrix ``Sw^-1/2 Sb Sw^-1/2`` with each image a class and its q views the samples
  (``delta = 1e-4``, ``eps = 1e-7`` as the paper).
* ``kmeans_silhouette``: the cosine silhouette of a 10-cluster k-means on the L2-normalised
  features; ``kmeans_view_agreement``: clusters fitted on first views, the share of second
  views that fall in their first view's cluster.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.evaluate.labelfree import alignment, effective_rank, uniformity, view_top1
from pipeline.evaluate.normalize import l2_normalize

LIDAR_DELTA = 1e-4  # Thilak et al., the ridge added to the within-class scatter
LIDAR_EPS = 1e-7
KMEANS_K = 10


def lidar(views: Tensor, delta: float = LIDAR_DELTA, eps: float = LIDAR_EPS) -> float:
    """LiDAR of ``(n, q, D)`` embeddings: n images (classes), q views each (samples).

    Returns:
        A number in ``[1, D]``.
    """
    x = views.double()
    n, q, d = x.shape
    mu_c = x.mean(dim=1)  # (n, D)
    mu = mu_c.mean(dim=0)
    sb = torch.cov((mu_c - mu).T, correction=1) if n > 1 else torch.zeros(d, d, dtype=x.dtype)
    w = (x - mu_c[:, None]).reshape(n * q, d)
    sw = w.T @ w / (n * (q - 1)) + delta * torch.eye(d, dtype=x.dtype)
    evals, evecs = torch.linalg.eigh(sw)
    inv_sqrt = evecs @ torch.diag(evals.clamp_min(1e-30).rsqrt()) @ evecs.T
    lam = torch.linalg.eigvalsh(inv_sqrt @ sb @ inv_sqrt).clamp_min(0)
    if float(lam.sum()) == 0.0:
        return 1.0
    p = lam / lam.sum() + eps
    return float(torch.exp(-(p * torch.log(p)).sum()))


def kmeans_scores(a: Tensor, b: Tensor, k: int = KMEANS_K, seed: int = 0) -> dict[str, float]:
    """Cosine silhouette of a k-means on ``a``'s normalised rows; share of ``b`` in ``a``'s cluster.

    Returns:
        ``{"kmeans_silhouette", "kmeans_view_agreement"}`` (silhouette 0 when all features
        fall into fewer than two clusters; agreement in %).
    """
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    za = l2_normalize(a.double()).numpy()
    zb = l2_normalize(b.double()).numpy()
    km = KMeans(n_clusters=k, n_init=3, random_state=seed).fit(za)
    la, lb = km.labels_, km.predict(zb)
    distinct = len(set(la.tolist()))
    sil = float(silhouette_score(za, la, metric="cosine")) if 1 < distinct < len(la) else 0.0
    return {"kmeans_silhouette": sil, "kmeans_view_agreement": 100.0 * float((la == lb).mean())}


class Candidates:
    """Every candidate number of a backbone, on fixed pretraining images and fixed views.

    Args:
        split: the built ``pretrain`` split.
        side: the training image side.
        mean: normalisation mean.
        std: normalisation std.
        preset: ``augment.preset``.
        crop_min_scale: ``augment.crop_min_scale``.
        n_rank: images for the large RankMe.
        n_views: images for alignment, uniformity, view retrieval, k-means.
        n_lidar: images for LiDAR.
        q_lidar: views per image for LiDAR (even).
    """

    def __init__(self, split: Path, *, side: int, mean: Any, std: Any, preset: str,
                 crop_min_scale: float, n_rank: int = 25600, n_views: int = 2048,
                 n_lidar: int = 512, q_lidar: int = 8) -> None:
        from pipeline.data.eval_loader import eval_loader
        from pipeline.data.views import BatchTwoCrop, build_batch_view
        from pipeline.train.monitor import uint8_transform

        loader = eval_loader(split, transform=uint8_transform(side), batch_size=512,
                             max_images=max(n_rank, n_views, n_lidar))
        self.images = torch.cat([x for x, _, _ in loader])  # (N, C, S, S) uint8
        self.views = BatchTwoCrop(build_batch_view(preset, side, mean, std, crop_min_scale,
                                                   crop=True))
        self.mean = torch.tensor(list(mean)).view(1, -1, 1, 1)
        self.std = torch.tensor(list(std)).view(1, -1, 1, 1)
        self.n_rank, self.n_views = min(n_rank, len(self.images)), n_views
        self.n_lidar, self.q_lidar = n_lidar, q_lidar

    @torch.no_grad()
    def _plain(self, net: nn.Module, n: int) -> Tensor:
        return torch.cat([net((self.images[i:i + 512].float() / 255 - self.mean) / self.std)
                          .float() for i in range(0, n, 512)])

    @torch.no_grad()
    def _views(self, net: nn.Module, n: int, seed: int) -> tuple[Tensor, Tensor]:
        from pipeline.train.monitor import VIEW_SEED

        a, b = [], []
        for i in range(0, n, 512):
            q, k = self.views(self.images[i:min(i + 512, n)], VIEW_SEED + seed + i)
            a.append(net(q).float())
            b.append(net(k).float())
        return torch.cat(a), torch.cat(b)

    def __call__(self, net: nn.Module) -> dict[str, float]:
        """All candidate numbers of ``net`` (put in eval mode)."""
        net.eval()
        plain = self._plain(net, self.n_rank)
        a, b = self._views(net, self.n_views, 0)
        out = {"rankme_2048": effective_rank(plain[:2048]),
               f"rankme_{self.n_rank}": effective_rank(plain),
               "alignment": alignment(a, b), "uniformity": uniformity(plain[:2048]),
               f"view_top1_{self.n_views}": view_top1(a, b),
               "view_top1_512": view_top1(a[:512], b[:512])}
        out.update(kmeans_scores(a, b))
        per = [self._views(net, self.n_lidar, 1_000_000 * (j + 1))
               for j in range(self.q_lidar // 2)]
        stack = torch.stack([v for pair in per for v in pair], dim=1)  # (n, q, D)
        out["lidar"] = lidar(stack)
        return {k: (v if math.isfinite(v) else float("nan")) for k, v in out.items()}
