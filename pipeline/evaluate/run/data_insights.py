"""The ``data_insights`` stage: near-duplicates and outliers among the pretraining images.

The pretraining set (the built ``pretrain`` split, ``data.unlabelled_root`` images included, and
the ``data.pretrain_shards`` read in place) is embedded with the exported encoder (eval
transform, global average pool of the last stage: the MoCo protocol's feature), then searched
for each image's nearest others (:mod:`pipeline.evaluate.insights`). The same pass collects,
per image, the first stage's channel statistics and the pixel statistics of the transformed
image, the outliers' other views. No labels are read.

When the built ``pretrain`` split is the ``train`` split's shards (the default run: the same
60,000 Fashion-MNIST images), the same forward pass also gives the ``embed`` stage's features of
those images (:class:`~pipeline.evaluate.run.embed.Embedder`, ``embed.*`` params), written to
``features/pretrain{,_global}.pt`` for ``embed`` to reuse, so the images are embedded once per
run; otherwise those two files are left empty (0 rows).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.atomic import write_json
from pipeline.config import EmbedParams, InsightsParams
from pipeline.data.eval_loader import eval_loader
from pipeline.data.index import pretrain_manifest
from pipeline.data.manifest import Manifest, read_manifest
from pipeline.data.remote import ShardURL
from pipeline.data.shards import image_spec, shard_location
from pipeline.data.views import build_eval_transform
from pipeline.evaluate.features import FeatureSet, file_backed, pick_device, save_features
from pipeline.evaluate.insights import (
    Neighbourhoods,
    channel_statistics,
    find_neighbourhoods,
    pixel_statistics,
    save_neighbourhoods,
)
from pipeline.evaluate.run.embed import Embedder, same_shards

log = logging.getLogger(__name__)
# metrics/data_insights.json (pipeline.atomic.headline): the embedding throughput; the pairs
# and outliers are in eval/data_insights.json, every number in eval/metrics/data_insights.json
HEADLINE = ("images_per_s", "wall_time_s")

COSINE_DECIMALS = 6  # cosines in eval/data_insights.json (fp32 resolution near 1 is ~6e-8)
Z_DECIMALS = 3  # outlier z-scores in eval/data_insights.json


class _Taps:
    """Per-image statistics taken during the embedding pass, in batch order.

    ``low_level``: :func:`channel_statistics` of the backbone's first stage (a forward hook on
    ``layer1`` of every :class:`Embedder` given to :meth:`attach`); ``pixels``:
    :func:`pixel_statistics` of each batch of transformed images (:meth:`batches`).
    """

    def __init__(self) -> None:
        self._low: list[Tensor] = []
        self._pixels: list[Tensor] = []

    def attach(self, embedder: Embedder) -> Embedder:
        embedder.backbone.layer1.register_forward_hook(
            lambda mod, inp, out: self._low.append(channel_statistics(out).cpu()))
        return embedder

    def batches(self, loader: Iterable[tuple[Tensor, Tensor, list[str]]]
                ) -> Iterator[tuple[Tensor, Tensor, list[str]]]:
        for images, labels, keys in loader:
            self._pixels.append(pixel_statistics(images).cpu())
            yield images, labels, keys

    def result(self, n: int) -> tuple[Tensor, Tensor]:
        """``(low_level (n, 2C), pixels (n, 3))``; a count other than ``n`` is a bug here."""
        low, pixels = torch.cat(self._low), torch.cat(self._pixels)
        self._low, self._pixels = [], []  # the batches go: the rows are held once
        if len(low) != n or len(pixels) != n:
            raise RuntimeError(f"data_insights: {len(low)} first-stage and {len(pixels)} pixel "
                               f"statistics for {n} images")
        return low, pixels


def _locations(where: Path | ShardURL, manifest: Manifest) -> list[str]:
    """The shard file or URL of every sample of a manifest, in manifest order."""
    return [shard_location(where, s) for s in manifest.shards for _ in range(s.num_samples)]


def _embed_set(*, encoder_path: Path, head_path: Path | None, shards_dir: Path | ShardURL,
               index_dir: Path | None, image_size: int, embed: EmbedParams,
               device: torch.device, taps: _Taps, rows_file: Path
               ) -> tuple[FeatureSet, list[str], FeatureSet | None, int]:
    """Global features of the whole pretraining set, and ``embed``'s of the built split.

    Both parts are read as pretraining reads them (:func:`pipeline.data.index.
    pretrain_manifest`: one mode, size and normalisation, e.g. colour shards read in place
    beside grey images are read grey).

    ``taps`` collects the per-image statistics of the same pass (:class:`_Taps`). ``embed``'s
    (N, D) features (2,048-d by default, 8 KB per image) are made in ``rows_file``
    (:func:`~pipeline.evaluate.features.file_backed`): the page cache holds them, not the
    process's anonymous memory; the caller removes the file.

    Returns:
        ``(global features (N, C) of the built split then the shards read in place, the
        shard of every row, (features, global features) of the built split for ``embed`` or
        None, images of the built split)``.
    """
    built = read_manifest(shards_dir / "pretrain")
    pretrain_set = pretrain_manifest(shards_dir, index_dir, image_size=image_size)
    spec = image_spec(pretrain_set, shards_dir / "pretrain")
    tf = build_eval_transform(spec.size, spec.mean, spec.std)
    reuse = same_shards(built, read_manifest(shards_dir / "train"))
    cut = len(built.shards)  # pretrain_set's shards: the built split's, then the indexed
    parts: list[tuple[Path | ShardURL, Manifest, str]] = [
        (shards_dir / "pretrain", built, "pretrain")]
    ext = read_manifest(index_dir) if index_dir is not None else None
    if ext is not None and ext.num_samples:
        log.info("data_insights: %d images of data.pretrain_shards, read in place",
                 ext.num_samples)
        parts.append((index_dir, ext, "data.pretrain_shards"))
    pooled: list[FeatureSet] = []
    where: list[str] = []
    for_embed = None
    for n, (directory, manifest, name) in enumerate(parts):
        if not manifest.num_samples:
            continue
        as_pretrained = replace(pretrain_set, num_samples=manifest.num_samples,
                                shards=pretrain_set.shards[cut:] if n else
                                pretrain_set.shards[:cut])
        embedder = taps.attach(
            Embedder(encoder_path, pool_grid=embed.pool_grid, layer=embed.layer,
                     head_path=head_path if embed.use_head else None, device=device)
            if reuse and n == 0 else Embedder(encoder_path, device=device))
        fs, g = embedder(taps.batches(eval_loader(directory, transform=tf,
                                                  batch_size=embed.batch_size,
                                                  manifest=as_pretrained)), desc=f"embed {name}",
                         rows=manifest.num_samples,
                         allocate=(lambda n, d: file_backed(rows_file, n, d))
                         if reuse and n == 0 else None)
        for_embed = (fs, g) if reuse and n == 0 else for_embed
        pooled.append(g)
        where += _locations(directory, manifest)
    features = pooled[0] if len(pooled) == 1 else FeatureSet(  # one part: no copy
        torch.cat([p.features for p in pooled]), torch.cat([p.labels for p in pooled]),
        [k for p in pooled for k in p.keys])
    return features, where, for_embed, built.num_samples


def _image(row: int, keys: list[str], where: list[str]) -> dict[str, Any]:
    return {"row": row, "key": keys[row], "shard": where[row]}


def _quantiles(values: Tensor, named: tuple[tuple[str, float], ...]) -> dict[str, float]:
    v = values.double().numpy()
    return {name: round(float(np.quantile(v, q)), COSINE_DECIMALS) for name, q in named}


def _outlier(nb: Neighbourhoods, row: int, reason: str, keys: list[str],
             where: list[str]) -> dict[str, Any]:
    return {**_image(row, keys, where), "score": round(float(nb.outlier_score[row]), Z_DECIMALS),
            "reason": reason, "mean_cosine": round(float(nb.mean_cosine[row]), COSINE_DECIMALS),
            "views": {name: round(float(z), Z_DECIMALS)
                      for name, z in zip(nb.view_names, nb.views[row].tolist())}}


def _details(nb: Neighbourhoods, keys: list[str], where: list[str], *, listed: int,
             parts: dict[str, int]) -> dict[str, Any]:
    """``eval/data_insights.json``: counts, thresholds, the listed pairs and outliers."""
    n_pairs = min(listed, len(nb.pairs))
    rows = nb.outliers(listed)
    return {
        "images": len(keys), "parts": parts, "k": nb.k, "duplicate_cosine": nb.duplicate_cosine,
        "duplicate_pairs": len(nb.pairs), "images_in_pairs": nb.images_in_pairs(),
        "views": list(nb.view_names),
        "outlier_score": _quantiles(nb.outlier_score, (("median", 0.5), ("p99", 0.99),
                                                       ("p999", 0.999), ("max", 1.0))),
        "mean_cosine": _quantiles(nb.mean_cosine, (("min", 0.0), ("p01", 0.01),
                                                   ("median", 0.5), ("max", 1.0))),
        "pairs": [{"cosine": round(float(c), COSINE_DECIMALS), "a": _image(int(i), keys, where),
                   "b": _image(int(j), keys, where)}
                  for (i, j), c in zip(nb.pairs[:n_pairs].tolist(), nb.pair_cosine[:n_pairs])],
        "outliers": [_outlier(nb, r, why, keys, where)
                     for r, why in zip(rows.tolist(), nb.reasons(rows))],
    }


def data_insights(*, encoder_path: Path, head_path: Path | None, shards_dir: Path | ShardURL,
                  index_dir: Path | None, image_size: int, embed: EmbedParams,
                  insights: InsightsParams, features_dir: Path, details_path: Path,
                  neighbourhoods_path: Path) -> dict[str, float]:
    """Embed the pretraining images, find near-duplicates and outliers, write the outputs.

    Writes ``details_path`` (``eval/data_insights.json``, :func:`_details`: every count, the
    ``insights.listed`` most similar pairs with their key, shard and cosine, and as many
    highest-scoring outliers with their score, reason, mean cosine to their neighbours and
    every view's z-score: :func:`pipeline.evaluate.insights.find_neighbourhoods`) and
    ``neighbourhoods_path`` (every image's global feature, outlier score and near-duplicate
    pairs) and ``features_dir/pretrain{,_global}.pt`` (``embed``'s features of the built split
    when it is the train split's shards, else empty; module docstring).

    Args:
        encoder_path: ``models/encoder.pt``.
        head_path: ``models/head.pt`` (used only with ``embed.use_head``).
        shards_dir: ``data.shards_dir`` (its ``pretrain`` and ``train`` splits are read).
        index_dir: ``data/index/pretrain`` when ``data.pretrain_shards`` is set, else None.
        image_size: ``data.image_size`` (the crop when no split fixes one).
        embed: the ``embed`` params (batch size; the features written for ``embed``).
        insights: the ``insights`` params.
        features_dir: where ``pretrain{,_global}.pt`` go.
        details_path: ``eval/data_insights.json``.
        neighbourhoods_path: ``features/insights.pt`` (:func:`save_neighbourhoods`: what the
            ``select_labels`` stage picks from).

    Returns:
        every number (``eval/metrics/data_insights.json``; :data:`HEADLINE` of them
        ``metrics/data_insights.json``): ``images``, ``duplicate_pairs``, ``images_in_pairs``,
        ``duplicate_cosine``, ``k``, ``outlier_score_median`` (the median image's largest view
        z-score), ``features_for_embed`` (1 when the features were written for ``embed``),
        ``embed_s``, ``images_per_s`` (embedding only), ``search_s`` (both searches and the
        z-scores) and ``wall_time_s`` (seconds).

    Raises:
        ShardError: no pretraining images, or a shard missing or altered.
        FileNotFoundError: the encoder is missing.
    """
    t0 = time.time()
    device = pick_device()
    taps = _Taps()
    rows_file = features_dir / ".pretrain.rows"  # embed's features while they are made
    try:
        features, where, for_embed, n_built = _embed_set(
            encoder_path=encoder_path, head_path=head_path, shards_dir=shards_dir,
            index_dir=index_dir, image_size=image_size, embed=embed, device=device, taps=taps,
            rows_file=rows_file)
        t_embed = time.time() - t0
        low_level, pixels = taps.result(len(features))
        nb = find_neighbourhoods(features.features, duplicate_cosine=insights.duplicate_cosine,
                                 k=insights.neighbours, low_level=low_level, pixels=pixels,
                                 device=device)
        t_search = time.time() - t0 - t_embed
        parts = {"built": n_built, "read_in_place": len(features) - n_built}
        details = _details(nb, features.keys, where, listed=insights.listed, parts=parts)
        write_json(details_path, details)
        save_neighbourhoods(neighbourhoods_path, features=features.features, keys=features.keys,
                            where=where, outlier_score=nb.outlier_score, pairs=nb.pairs,
                            built=n_built, built_is_train=for_embed is not None)
        empty = FeatureSet(torch.zeros(0, 0), torch.zeros(0, dtype=torch.long), [])
        for name, fs in zip(("pretrain", "pretrain_global"), for_embed or (empty, empty)):
            save_features(fs, features_dir / f"{name}.pt")
        log.info("data_insights: %d images, %d near-duplicate pairs at cosine >= %g, embed "
                 "%.1fs, search %.1fs", len(features), len(nb.pairs), nb.duplicate_cosine,
                 t_embed, t_search)
        return {"images": len(features), "duplicate_pairs": len(nb.pairs),
                "images_in_pairs": details["images_in_pairs"],
                "duplicate_cosine": nb.duplicate_cosine, "k": nb.k,
                "outlier_score_median": details["outlier_score"]["median"],
                "features_for_embed": int(for_embed is not None), "embed_s": t_embed,
                "images_per_s": len(features) / max(t_embed, 1e-9),
                "search_s": t_search, "wall_time_s": time.time() - t0}
    finally:
        rows_file.unlink(missing_ok=True)
