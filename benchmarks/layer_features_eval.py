"""kNN and linear probe of one trained encoder's ``layer3`` and ``layer4`` features, and of both.

What it answers: whether a frozen encoder pretrained for a few CPU epochs holds more in its
third stage than in its last, and whether the two together beat the last alone, without more
pretraining. The last stage of a short contrastive pretraining is the most tuned to the
pretext task; the stage before keeps more of the image.

It embeds the labelled train/test shards once with the embed stage's transform: ``layer3``'s
output and ``layer4``'s, each average-pooled to the ``embed.pool_grid`` of the params (2 x 2 at
28 px: ``layer3`` is 4 x 4 there, ``layer4`` 2 x 2) and flattened channel-major. The ``layer4``
rows are checked against ``features/train.pt``, the embed stage's own. Then, per variant:

* ``layer4``: the pipeline's features;
* ``layer3``;
* ``layer3+layer4``: each part L2-normalised, then concatenated and scaled by ``1/sqrt(2)``, so
  the cosine similarity of two rows is the mean of the two parts' cosine similarities;

kNN as ``knn.select: val`` (k and T chosen on 10 % of TRAIN: ``knn_val``; test top-1 with the
whole train bank: ``knn_test``) and the params' linear probe with 10 % of TRAIN held out
(``linear_val``; ``linear_test_90`` is its test top-1 trained on the other 90 %), as
``benchmarks/encoder_variants_eval.py`` does. Prints one JSON line per variant. Deterministic
for a given machine; nothing chooses on test.

Usage, after ``dvc repro``: ``python benchmarks/layer_features_eval.py`` (about 10 min for
Fashion-MNIST at width 32 on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import Tensor, nn

from pipeline.config import load_params
from pipeline.data.loader import eval_loader
from pipeline.data.shards import image_spec, read_manifest
from pipeline.data.views import build_eval_transform
from pipeline.evaluate.features import FeatureSet, extract_features, load_features
from pipeline.evaluate.knn import knn_classify, select_on_heldout
from pipeline.evaluate.linear import train_linear_on_features
from pipeline.evaluate.normalize import l2_normalize
from pipeline.evaluate.run.embed import build_encoder


class TwoStages(nn.Module):
    """A ResNet backbone whose forward returns ``[layer3 pooled, layer4 pooled]`` side by side.

    Both stages are average-pooled to ``grid x grid`` and flattened channel-major, so the
    output is ``(B, C3 * g * g + C4 * g * g)``; ``layer4``'s part equals the backbone's own
    forward with ``embed.pool_grid = g``.
    """

    def __init__(self, backbone: nn.Module, grid: int) -> None:
        super().__init__()
        self.backbone, self.grid, self._layer3 = backbone, grid, None
        backbone.layer3.register_forward_hook(self._keep)

    def _keep(self, _module: nn.Module, _inputs: tuple, output: Tensor) -> None:
        self._layer3 = output

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, C3 * g * g + C4 * g * g) features."""
        last = self.backbone(x)
        third = nn.functional.adaptive_avg_pool2d(self._layer3, self.grid).flatten(1)
        return torch.cat([third, last], dim=1)


def embed_split(model: nn.Module, shards: Path, split: str) -> FeatureSet:
    """The ``(N, D3 + D4)`` features of one labelled split, in shard order."""
    spec = image_spec(read_manifest(shards / split), shards / split)
    return extract_features(model, eval_loader(
        shards / split, transform=build_eval_transform(spec.size, spec.mean, spec.std),
        batch_size=512, num_workers=0), device="cpu", progress=False)


def variants(fs: FeatureSet, d3: int) -> dict[str, FeatureSet]:
    """``layer4``, ``layer3`` and ``layer3+layer4`` (each part L2-normalised, / sqrt 2)."""
    third, last = fs.features[:, :d3], fs.features[:, d3:]
    both = torch.cat([l2_normalize(third), l2_normalize(last)], dim=1) / math.sqrt(2.0)
    return {name: FeatureSet(f.contiguous(), fs.labels, fs.keys)
            for name, f in (("layer4", last), ("layer3", third), ("layer3+layer4", both))}


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
    args = ap.parse_args()
    p = load_params(args.params)
    shards, grid = Path(p.data.shards_dir), p.embed.pool_grid
    meta = json.loads(args.encoder.with_suffix(".json").read_text())
    weights = torch.load(args.encoder, map_location="cpu", weights_only=True)
    backbone = build_encoder(weights, meta, pool_grid=grid, where=str(args.encoder))[0]
    model = TwoStages(backbone, grid)
    num_classes = len(read_manifest(shards / "test")["class_names"])
    d3 = backbone.layer3[-1].conv2.out_channels * grid * grid
    train, test = (embed_split(model, shards, s) for s in ("train", "test"))
    ref = load_features(Path("features/train.pt")).features
    if not torch.allclose(ref, train.features[:, d3:], atol=1e-4):
        raise SystemExit("the layer4 part is not features/train.pt")
    tests = variants(test, d3)
    for name, tr in variants(train, d3).items():
        row = {"features": name, "dim": tr.features.shape[1],
               **evaluate(tr, tests[name], p.seed, num_classes)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
