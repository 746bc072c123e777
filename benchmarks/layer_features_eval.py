"""kNN and linear probe of one trained encoder's earlier stages, alone and with ``layer4``.

What it answers: whether a frozen encoder pretrained for a few CPU epochs holds more in an
earlier stage than in its last, and whether stages together beat the last alone, without more
pretraining. The last stage of a short contrastive pretraining is the most tuned to the
pretext task; the stages before keep more of the image.

It embeds the labelled train/test shards once with the embed stage's transform, keeping the
maps of ``layer2``, ``layer3`` and ``layer4`` (at 28 px with the stride-2 stem: 7 x 7, 4 x 4
and 2 x 2), each average-pooled to a ``g x g`` grid and flattened channel-major
(:data:`PARTS`). When the params' ``embed.layer`` / ``embed.pool_grid`` are one of the parts
(the default's ``layer3@4``, or ``layer4@2``), that part is checked against
``features/train.pt``, the embed stage's own. A variant (:data:`VARIANTS`) of several parts
L2-normalises each, concatenates them and scales by ``1/sqrt(n)``, so the cosine similarity
of two rows is the mean of the parts' cosine similarities. Per variant:

* kNN as ``knn.select: val``: k and T chosen on 10 % of TRAIN (``knn_val``), the test top-1
  with the whole train bank (``knn_test``);
* the params' linear probe (l2 features, lr 30, 100 epochs) with 10 % of TRAIN held out
  (``linear_val``, the number to choose on; ``linear_test_90`` is its test top-1 trained on
  the other 90 %), as ``benchmarks/encoder_variants_eval.py`` does.

Prints one JSON line per variant. Deterministic for a given machine; nothing chooses on test.

Usage, after ``dvc repro``: ``python benchmarks/layer_features_eval.py [--variants ...]``
(about 3 min per variant for Fashion-MNIST at width 32 on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import Tensor, nn

from pipeline.config import load_params
from pipeline.data.eval_loader import eval_loader
from pipeline.data.shards import image_spec, read_manifest
from pipeline.data.views import build_eval_transform
from pipeline.evaluate.features import FeatureSet, extract_features, load_features
from pipeline.evaluate.knn import knn_classify, select_on_heldout
from pipeline.evaluate.linear import train_linear_on_features
from pipeline.evaluate.normalize import l2_normalize
from pipeline.evaluate.run.embed import build_encoder

PARTS = (("layer2", 2), ("layer3", 2), ("layer3", 4), ("layer4", 2))  # (stage, grid)
VARIANTS = {  # name: the parts, each L2-normalised, concatenated, / sqrt(number of parts)
    "layer4": ["layer4@2"],
    "layer3": ["layer3@2"],
    "layer3+layer4": ["layer3@2", "layer4@2"],
    "layer3 4x4": ["layer3@4"],
    "layer3 4x4+layer4": ["layer3@4", "layer4@2"],
    "layer2": ["layer2@2"],
    "layer2+layer3+layer4": ["layer2@2", "layer3@2", "layer4@2"],
}


class Stages(nn.Module):
    """A ResNet backbone whose forward returns the pooled maps of several stages side by side.

    Each ``(stage, grid)`` of :data:`PARTS` is average-pooled to ``grid x grid`` and flattened
    channel-major; the output is ``(B, sum of C_stage * grid * grid)`` in :data:`PARTS` order.
    ``layer4@2`` equals the backbone's own forward with ``embed.pool_grid = 2``.
    """

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone, self.maps = backbone, {}
        for name in {stage for stage, _ in PARTS}:
            getattr(backbone, name).register_forward_hook(self._keeper(name))

    def _keeper(self, name: str):
        def keep(_module: nn.Module, _inputs: tuple, output: Tensor) -> None:
            self.maps[name] = output
        return keep

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, D) features, the parts of :data:`PARTS` in order."""
        self.backbone(x)
        return torch.cat([nn.functional.adaptive_avg_pool2d(self.maps[stage], grid).flatten(1)
                          for stage, grid in PARTS], dim=1)


def part_columns(backbone: nn.Module) -> dict[str, slice]:
    """``{"layer3@2": slice, ...}``: the columns of each part in :class:`Stages`' output."""
    out, start = {}, 0
    for stage, grid in PARTS:
        width = getattr(backbone, stage)[-1].conv2.out_channels * grid * grid
        out[f"{stage}@{grid}"] = slice(start, start + width)
        start += width
    return out


def embed_split(model: nn.Module, shards: Path, split: str) -> FeatureSet:
    """The :class:`Stages` features of one labelled split, in shard order."""
    spec = image_spec(read_manifest(shards / split), shards / split)
    return extract_features(model, eval_loader(
        shards / split, transform=build_eval_transform(spec.size, spec.mean, spec.std),
        batch_size=512, num_workers=0), device="cpu", progress=False)


def variant(fs: FeatureSet, columns: dict[str, slice], parts: list[str]) -> FeatureSet:
    """The parts' columns, each L2-normalised, concatenated and scaled by ``1/sqrt(len)``.

    A single part is returned as it is (kNN and the l2 probe normalise it anyway).
    """
    if len(parts) == 1:
        f = fs.features[:, columns[parts[0]]]
    else:
        f = torch.cat([l2_normalize(fs.features[:, columns[p]]) for p in parts], dim=1)
        f = f / math.sqrt(len(parts))
    return FeatureSet(f.contiguous(), fs.labels, fs.keys)


def evaluate(tr: FeatureSet, te: FeatureSet, seed: int, num_classes: int) -> dict[str, float]:
    """kNN (k, T chosen on held-out TRAIN) and the held-out linear probe."""
    sel, _ = select_on_heldout(tr.features, tr.labels, seed=seed)
    knn = knn_classify(tr.features, tr.labels, te.features, te.labels, k=sel.k, T=sel.T,
                       num_classes=num_classes)
    lin = train_linear_on_features(tr, te, val_fraction=0.1, seed=seed,
                                   num_classes=num_classes, feature_norm="l2")
    return {"knn_val": round(sel.val_top1, 2), "knn_k": sel.k, "knn_T": sel.T,
            "knn_test": round(knn.top1, 2), "linear_val": round(lin.val_top1, 2),
            "linear_test_90": round(lin.top1, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoder", type=Path, default=Path("models/encoder.pt"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: all")
    args = ap.parse_args()
    p = load_params(args.params)
    shards = Path(p.data.shards_dir)
    meta = json.loads(args.encoder.with_suffix(".json").read_text())
    weights = torch.load(args.encoder, map_location="cpu", weights_only=True)
    backbone = build_encoder(weights, meta, pool_grid=2, where=str(args.encoder))[0]
    model = Stages(backbone)
    columns = part_columns(backbone)
    num_classes = len(read_manifest(shards / "test").class_names)
    train, test = (embed_split(model, shards, s) for s in ("train", "test"))
    part = f"layer{p.embed.layer}@{p.embed.pool_grid}"
    if part in columns:
        ref = load_features(Path("features/train.pt")).features
        if not torch.allclose(ref, train.features[:, columns[part]], atol=1e-4):
            raise SystemExit(f"the {part} part is not features/train.pt")
    for name in args.variants or VARIANTS:
        tr, te = (variant(fs, columns, VARIANTS[name]) for fs in (train, test))
        row = {"features": name, "dim": tr.features.shape[1],
               **evaluate(tr, te, p.seed, num_classes)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
