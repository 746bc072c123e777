"""The ``embed`` stage: frozen features of the labelled train and test shards."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor, nn

from pipeline.atomic import write_atomic
from pipeline.data.eval_loader import eval_loader
from pipeline.data.manifest import Manifest, read_manifest
from pipeline.data.remote import ShardURL
from pipeline.data.shards import image_spec
from pipeline.data.views import build_eval_transform
from pipeline.errors import InputError
from pipeline.evaluate.features import (
    FeatureSet,
    extract_features,
    load_features,
    pick_device,
    save_features,
)
from pipeline.evaluate.pooling import set_pool_grid
from pipeline.moco.backbones import build_backbone, build_head

log = logging.getLogger(__name__)
# metrics/embed.json (pipeline.atomic.headline); eval/metrics/embed.json holds every number
HEADLINE = ("images_per_s", "wall_time_s")


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


class Embedder:
    """The embed stage's features of any shards: ``embed.*``'s features and the global pool.

    One forward pass per batch gives both: the map of stage ``layer`` average-pooled to
    ``pool_grid x pool_grid`` cells and flattened (or, with a head, the projection head's output
    on the globally pooled last stage), and the last stage's global average pool, the feature
    of the MoCo evaluation protocol (computed by running the later stages on the pooled
    stage's map when ``layer`` < 4).
    """

    def __init__(self, encoder_path: Path, *, pool_grid: int = 1, layer: int = 4,
                 head_path: Path | None = None, device: torch.device | None = None) -> None:
        """Load the encoder (and head) onto ``device``.

        Args:
            encoder_path: ``models/encoder.pt`` (its ``.json`` sidecar next to it).
            pool_grid: ``embed.pool_grid``.
            layer: ``embed.layer``.
            head_path: ``models/head.pt`` when ``embed.use_head``, else None.
            device: default :func:`pick_device`.

        Raises:
            FileNotFoundError: the encoder or the head is missing.
            ValueError: a head with ``pool_grid`` > 1 or ``layer`` < 4 (the head takes the last
                stage's ``(N, C)`` pooled features).
        """
        if head_path is not None and (pool_grid != 1 or layer != 4):
            raise InputError(f"embed.pool_grid = {pool_grid}, embed.layer = {layer} with "
                             "embed.use_head: the projection head takes the last stage globally "
                             "pooled; set embed.pool_grid: 1 and embed.layer: 4")
        self.device = device or pick_device()
        backbone, _ = load_encoder(encoder_path)
        # the stages after `layer`, kept to compute the protocol's global feature from its map
        self.tail = nn.Sequential(*(getattr(backbone, f"layer{i}") for i in range(layer + 1, 5)))
        set_pool_grid(backbone, pool_grid, layer)
        self.backbone = backbone.to(self.device)
        self.tail.to(self.device).eval()
        self.head = None
        if head_path is not None:
            if not Path(head_path).is_file():
                raise FileNotFoundError(f"embed.use_head is true but {head_path} is missing")
            payload = torch.load(head_path, map_location="cpu", weights_only=True)
            self.head = _load_head(payload).to(self.device)
        self._pooled: list[Tensor] = []  # (B, C) global average of the last stage, per batch
        backbone.avgpool.register_forward_hook(lambda mod, inp, out: self._pooled.append(
            self.tail(inp[0]).float().mean(dim=(-2, -1)).cpu()))

    def __call__(self, batches: Iterable[tuple[Tensor, Tensor, list[str]]], *,
                 desc: str, rows: int | None = None,
                 allocate: Callable[[int, int], Tensor] | None = None
                 ) -> tuple[FeatureSet, FeatureSet]:
        """``(features, global features)`` of the batches, (N, D) and (N, C), in batch order.

        Args:
            batches: an :func:`~pipeline.data.eval_loader.eval_loader` (eval transform).
            desc: the progress bar's label.
            rows: N when known (:func:`~pipeline.evaluate.features.extract_features`).
            allocate: where the (N, D) features are made (the same function's).
        """
        self._pooled.clear()
        fs = extract_features(self.backbone, batches, device=self.device, head=self.head,
                              desc=desc, rows=rows, allocate=allocate)
        pooled, self._pooled = torch.cat(self._pooled), []
        return fs, FeatureSet(pooled, fs.labels, fs.keys)


def same_shards(a: Manifest, b: Manifest) -> bool:
    """Whether two split manifests hold the same images with the same evaluation transform.

    The same non-empty list of shard files (name, sha256, samples), image geometry and
    normalisation: their features are then the same, so one split's features serve the other
    (the default run's ``pretrain`` and ``train`` splits are the same 60,000 images).
    """
    def files(m: Manifest) -> list[tuple[Any, ...]]:
        return [(s.name, s.sha256, s.num_samples) for s in m.shards]

    return (bool(a.num_samples) and files(a) == files(b) and a.mode == b.mode
            and image_spec(a, "a") == image_spec(b, "b"))


def embed(*, encoder_path: Path, shards_dir: Path | ShardURL, out_dir: Path, batch_size: int,
          use_head: bool = False, head_path: Path | None = None,
          num_workers: int = 0, pool_grid: int = 1, layer: int = 4,
          reuse_dir: Path | None = None) -> dict[str, float]:
    """Frozen features of the labelled train and test shards (eval transform, BN in eval mode).

    The features are the map of the backbone's stage ``layer`` (``embed.layer``; 4 = the last
    stage) average-pooled to ``pool_grid x pool_grid`` cells and flattened (``embed.pool_grid``;
    layer 4 with grid 1 = global average pooling, the MoCo protocol), or, with ``use_head``,
    the projection head's output on the globally pooled last stage (:class:`Embedder`).

    Writes ``out_dir/train.pt`` and ``out_dir/test.pt`` (``FeatureSet``: (N, D) float32,
    (N,) labels, keys), and ``out_dir/{train,test}_global.pt``: the same images' backbone
    last stage's features globally average-pooled, ``(N, C)``, the feature of the MoCo
    evaluation protocol (the same as ``train.pt`` when ``layer`` is 4, ``pool_grid`` 1 and there
    is no head).

    The train split's features are copied from ``reuse_dir/pretrain{,_global}.pt`` (the
    ``data_insights`` stage's, computed by the same :class:`Embedder` with the same params),
    byte for byte (one DVC cache entry for both), when the train split is the pretrain split's
    shards (:func:`same_shards`) and those files hold them (:func:`reused_features`);
    ``train_reused`` says so (1) in the returned metrics.

    Returns:
        ``{split}_images``, ``{split}_images_per_s`` (extraction only; absent for a reused
        split), ``dim`` (D), ``global_dim`` (C), ``images_per_s`` (the embedded splits,
        extraction only), ``pool_grid``, ``layer``, ``train_reused`` and ``wall_time_s``
        (seconds, from loading the encoder to the saved features).

    Raises:
        FileNotFoundError: the encoder or the shards are missing.
        ValueError: ``use_head`` with ``pool_grid`` > 1 or ``layer`` < 4, or a ``pool_grid``
            larger than the pooled stage's map (nothing is written then).
    """
    t_start = time.time()
    if use_head and head_path is None:
        raise FileNotFoundError("embed.use_head is true but no head file was given")
    embedder = Embedder(encoder_path, pool_grid=pool_grid, layer=layer,
                        head_path=head_path if use_head else None)
    metrics: dict[str, float] = {"pool_grid": pool_grid, "layer": layer, "train_reused": 0}
    done: dict[str, FeatureSet] = {}
    embed_s: dict[str, float] = {}
    for split in ("train", "test"):
        spec = image_spec(read_manifest(shards_dir / split), shards_dir / split)
        tf = build_eval_transform(spec.size, spec.mean, spec.std)
        reused = (reused_features(embedder, shards_dir, reuse_dir, transform=tf,
                                  batch_size=batch_size) if split == "train" else None)
        t0 = time.time()
        if reused is not None:
            fs, pooled = reused
            metrics["train_reused"] = 1
            log.info("train: the features of the same shards in %s/pretrain*.pt", reuse_dir)
        else:
            fs, pooled = embedder(eval_loader(shards_dir / split, transform=tf,
                                              batch_size=batch_size, num_workers=num_workers),
                                  desc=f"embed {split}",  # one (N, D) tensor, filled in place
                                  rows=read_manifest(shards_dir / split).num_samples)
            dt = embed_s[split] = time.time() - t0
            metrics[f"{split}_images_per_s"] = len(fs) / max(dt, 1e-9)
            log.info("embedded %d %s images in %.1fs", len(fs), split, dt)
        done[split], done[f"{split}_global"] = fs, pooled
        metrics[f"{split}_images"] = len(fs)
        metrics["global_dim"] = pooled.features.shape[1]
        metrics["dim"] = fs.features.shape[1]
    # written only once both splits are embedded: a failure leaves the previous pair intact
    for split, fs in done.items():
        if metrics["train_reused"] and split.startswith("train"):  # the same bytes: one
            source = reuse_dir / f"{split.replace('train', 'pretrain')}.pt"  # DVC cache entry
            write_atomic(out_dir / f"{split}.pt", _copy_from(source))
        else:
            save_features(fs, out_dir / f"{split}.pt")
    n_images = sum(len(done[s]) for s in embed_s)
    metrics["images_per_s"] = n_images / max(sum(embed_s.values()), 1e-9)
    metrics["wall_time_s"] = time.time() - t_start
    return metrics


def reused_features(embedder: Embedder, shards_dir: Path | ShardURL, reuse_dir: Path | None, *,
                    transform: Any, batch_size: int) -> tuple[FeatureSet, FeatureSet] | None:
    """The train split's ``(features, global features)`` from ``reuse_dir``, or None.

    They are ``reuse_dir/pretrain.pt`` and ``pretrain_global.pt`` when the train split is the
    pretrain split's shards (:func:`same_shards`), the files hold one row per train image (the
    ``data_insights`` stage leaves them empty otherwise), and their first batch equals what
    ``embedder`` gives for it (the same encoder and ``embed`` params: one batch of checking,
    so features of another encoder or setting are never passed on).
    """
    if reuse_dir is None or not (reuse_dir / "pretrain.pt").is_file():
        return None
    train = read_manifest(shards_dir / "train")
    if not same_shards(read_manifest(shards_dir / "pretrain"), train):
        return None
    fs, pooled = (load_features(reuse_dir / f"pretrain{s}.pt") for s in ("", "_global"))
    if len(fs) != train.num_samples or len(pooled) != len(fs):
        return None
    b = min(batch_size, len(fs))
    check, check_pooled = embedder(eval_loader(shards_dir / "train", transform=transform,
                                               batch_size=b, max_images=b), desc="check")
    same = (check.keys == fs.keys[:b] and check.features.shape[1] == fs.features.shape[1]
            and check_pooled.features.shape[1] == pooled.features.shape[1]
            and torch.allclose(check.features, fs.features[:b], atol=1e-4, rtol=1e-4)
            and torch.allclose(check_pooled.features, pooled.features[:b], atol=1e-4, rtol=1e-4))
    if not same:
        log.warning("%s/pretrain*.pt are not this encoder's embed.* features of the train "
                    "split: embedding it", reuse_dir)
        return None
    return fs, pooled


def _copy_from(source: Path) -> Callable[[IO[bytes]], None]:
    """A :func:`~pipeline.atomic.write_atomic` writer that streams ``source``'s bytes."""
    def write(f: IO[bytes]) -> None:
        with source.open("rb") as src:
            shutil.copyfileobj(src, f, 16 * 2**20)

    return write


def _load_head(payload: dict[str, Any]) -> nn.Module:
    head = build_head(payload["kind"], payload["in_dim"], payload["hidden"], payload["dim"])
    head.load_state_dict(payload["state_dict"])
    return head
