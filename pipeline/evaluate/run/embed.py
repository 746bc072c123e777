"""The ``embed`` stage: frozen features of the labelled train and test shards."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.data.loader import eval_loader
from pipeline.data.remote import ShardURL
from pipeline.data.shards import image_spec, read_manifest
from pipeline.data.views import build_eval_transform
from pipeline.errors import InputError
from pipeline.evaluate.features import FeatureSet, extract_features, pick_device, save_features
from pipeline.evaluate.pooling import set_pool_grid
from pipeline.moco.backbones import build_backbone, build_head

log = logging.getLogger(__name__)


def load_encoder(encoder_path: Path, *, pool_grid: int = 1,
                 layer: int = 4) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the exported backbone from ``encoder.pt`` + ``encoder.json``.

    Args:
        encoder_path: ``models/encoder.pt`` (its ``.json`` sidecar next to it).
        pool_grid: ``embed.pool_grid`` (see :func:`build_encoder`).
        layer: ``embed.layer`` (see :func:`build_encoder`).

    Returns:
        See :func:`build_encoder`.

    Raises:
        FileNotFoundError: a file is missing.
        InputError: the weights do not fit the recorded architecture.
        ValueError: ``pool_grid < 1`` or ``layer`` not 1..4.
    """
    meta = json.loads(Path(encoder_path).with_suffix(".json").read_text())
    sd = torch.load(encoder_path, map_location="cpu", weights_only=True)
    return build_encoder(sd, meta, pool_grid=pool_grid, layer=layer, where=str(encoder_path))


def build_encoder(state_dict: dict[str, Tensor], meta: dict[str, Any], *, pool_grid: int = 1,
                  layer: int = 4, where: str = "state_dict") -> tuple[nn.Module, dict[str, Any]]:
    """A backbone of ``encoder.json``'s architecture holding ``state_dict``'s weights.

    Args:
        state_dict: torchvision-style backbone weights (``fc.*`` may be absent).
        meta: ``encoder.json``'s fields (``backbone``, ``width``, ``in_channels``,
            ``small_stem``, ``stem_stride``).
        pool_grid: ``embed.pool_grid``: the pooled stage's map average-pooled to ``g x g``
            cells and flattened (see :class:`~pipeline.evaluate.pooling.GridPool`); 1 = global
            pooling.
        layer: ``embed.layer``: the stage whose map is pooled (4 = the last stage); the later
            stages are left out of the module (:func:`~pipeline.evaluate.pooling.set_pool_grid`).
        where: names the weights in the error message.

    Returns:
        (backbone with ``fc = Identity`` giving ``(N, num_features)`` features, metadata whose
        ``num_features`` is that width, ``C_layer * pool_grid**2``, plus ``pool_grid`` and
        ``layer``).

    Raises:
        InputError: the weights do not fit the architecture (anything but ``fc.*`` missing,
            or unexpected keys).
        ValueError: ``pool_grid < 1`` or ``layer`` not 1..4.
    """
    backbone = build_backbone(meta["backbone"], width=meta["width"],
                              in_channels=meta["in_channels"], small_stem=meta["small_stem"],
                              stem_stride=meta.get("stem_stride", 1))
    missing, unexpected = backbone.load_state_dict(state_dict, strict=False)
    if unexpected or any(not k.startswith("fc.") for k in missing):
        raise InputError(f"{where} does not fit {meta['backbone']} width "
                         f"{meta['width']}: missing {missing}, unexpected {unexpected}")
    meta = {**meta, "num_features": set_pool_grid(backbone, pool_grid, layer),
            "pool_grid": pool_grid, "layer": layer}
    return backbone, meta


def embed(*, encoder_path: Path, shards_dir: Path | ShardURL, out_dir: Path, batch_size: int,
          use_head: bool = False, head_path: Path | None = None,
          num_workers: int = 0, pool_grid: int = 1, layer: int = 4) -> dict[str, float]:
    """Frozen features of the labelled train and test shards (eval transform, BN in eval mode).

    The features are the map of the backbone's stage ``layer`` (``embed.layer``; 4 = the last
    stage) average-pooled to ``pool_grid x pool_grid`` cells and flattened (``embed.pool_grid``;
    layer 4 with grid 1 = global average pooling, the MoCo protocol), or, with ``use_head``,
    the projection head's output on the globally pooled last stage.

    Writes ``out_dir/train.pt`` and ``out_dir/test.pt`` (``FeatureSet``: (N, D) float32,
    (N,) labels, keys), and ``out_dir/{train,test}_global.pt``: the same images' backbone
    last stage's features globally average-pooled, ``(N, C)``, the feature of the MoCo
    evaluation protocol (the same as ``train.pt`` when ``layer`` is 4, ``pool_grid`` 1 and there
    is no head). With ``layer`` < 4 the later stages run on the pooled stage's map for them.

    Returns:
        ``{split}_images``, ``{split}_images_per_s`` (extraction only), ``dim`` (D),
        ``global_dim`` (C), ``images_per_s`` (both splits, extraction only), ``pool_grid``,
        ``layer`` and ``wall_time_s`` (seconds, from loading the encoder to the saved features).

    Raises:
        FileNotFoundError: the encoder or the shards are missing.
        ValueError: ``use_head`` with ``pool_grid`` > 1 or ``layer`` < 4 (the head takes the
            last stage's ``(N, C)`` pooled features), or a ``pool_grid`` larger than the pooled
            stage's map (nothing is written then).
    """
    t_start = time.time()
    if use_head and (pool_grid != 1 or layer != 4):
        raise InputError(f"embed.pool_grid = {pool_grid}, embed.layer = {layer} with "
                         "embed.use_head: the projection head takes the last stage globally "
                         "pooled; set embed.pool_grid: 1 and embed.layer: 4")
    device = pick_device()
    backbone, _ = load_encoder(encoder_path)
    # the stages after `layer`, kept to compute the protocol's global feature from its map
    tail = nn.Sequential(*(getattr(backbone, f"layer{i}") for i in range(layer + 1, 5)))
    set_pool_grid(backbone, pool_grid, layer)
    backbone.to(device)
    tail.to(device).eval()
    head = None
    if use_head:
        if head_path is None or not Path(head_path).is_file():
            raise FileNotFoundError(f"embed.use_head is true but {head_path} is missing")
        head = torch.load(head_path, map_location="cpu", weights_only=True)
        head = _load_head(head).to(device)
    metrics: dict[str, float] = {"pool_grid": pool_grid, "layer": layer}
    done: dict[str, FeatureSet] = {}
    pooled: list[Tensor] = []  # (B, C) global average of the last stage, batch by batch
    backbone.avgpool.register_forward_hook(
        lambda mod, inp, out: pooled.append(tail(inp[0]).float().mean(dim=(-2, -1)).cpu()))
    embed_s: dict[str, float] = {}
    for split in ("train", "test"):
        spec = image_spec(read_manifest(shards_dir / split), shards_dir / split)
        t0 = time.time()
        fs = extract_features(backbone, eval_loader(
            shards_dir / split, transform=build_eval_transform(spec.size, spec.mean, spec.std),
            batch_size=batch_size, num_workers=num_workers), device=device, head=head,
            desc=f"embed {split}")
        dt = embed_s[split] = time.time() - t0
        done[split] = fs
        done[f"{split}_global"] = FeatureSet(torch.cat(pooled), fs.labels, fs.keys)
        pooled.clear()
        metrics[f"{split}_images"] = len(fs)
        metrics["global_dim"] = done[f"{split}_global"].features.shape[1]
        metrics[f"{split}_images_per_s"] = len(fs) / max(dt, 1e-9)
        metrics["dim"] = fs.features.shape[1]
        log.info("embedded %d %s images in %.1fs", len(fs), split, dt)
    # written only once both splits are embedded: a failure leaves the previous pair intact
    for split, fs in done.items():
        save_features(fs, out_dir / f"{split}.pt")
    n_images = len(done["train"]) + len(done["test"])
    metrics["images_per_s"] = n_images / max(sum(embed_s.values()), 1e-9)
    metrics["wall_time_s"] = time.time() - t_start
    return metrics


def _load_head(payload: dict[str, Any]) -> nn.Module:
    head = build_head(payload["kind"], payload["in_dim"], payload["hidden"], payload["dim"])
    head.load_state_dict(payload["state_dict"])
    return head
