"""kNN and linear probe of one pretraining's query and key (momentum) backbones, with and
without horizontal-flip test-time averaging.

What it answers: whether an evaluation-side change lifts the frozen features without more
pretraining: the key encoder (the EMA of the query encoder, which MoCo exports nothing of) and
the average of the features of an image and of its mirror image. It reads the resume
checkpoint of a finished run (``.checkpoints/pretrain/<fingerprint>/last.pt``: both encoders)
and checks that its query backbone is bit-identical to ``models/encoder.pt``. Each variant
embeds the labelled train/test shards with the embed stage's transform and the 2 x 2 grid of
``embed.pool_grid: 2``; the global-pool feature is the mean of the 4 cells (checked against
``features/train_global.pt`` for the query backbone). Then, per variant:

* kNN as ``knn.select: val``: k and T chosen on 10 % of TRAIN (``knn_val``), the test top-1
  with the whole train bank (``knn_test``);
* the linear probe of the params (l2 features, lr 30, 100 epochs) with 10 % of TRAIN held out
  (``linear_val``, the number to choose on; ``linear_test_90`` is its test top-1 trained on the
  other 90 %);
* the MoCo-protocol kNN (k=200, T=0.1, global pool; ``protocol_knn_test``).

Prints one JSON line per variant. Deterministic for a given machine; nothing chooses on test.

Usage, after ``dvc repro``:
``python benchmarks/encoder_variants_eval.py --checkpoint .checkpoints/pretrain/<fp>/last.pt``
(about 25 min for Fashion-MNIST at width 32 on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from pipeline.config import load_params
from pipeline.data.eval_loader import eval_loader
from pipeline.data.shards import image_spec, read_manifest
from pipeline.data.views import build_eval_transform
from pipeline.evaluate.features import FeatureSet, extract_features, load_features
from pipeline.evaluate.knn import DEFAULT_K, DEFAULT_T, knn_classify, select_on_heldout
from pipeline.evaluate.linear import train_linear_on_features
from pipeline.evaluate.run.embed import build_encoder

GRID = 2


class FlipAverage(nn.Module):
    """``(f(x) + f(flip(x))) / 2``: features averaged over the image and its mirror image."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, D) features."""
        return 0.5 * (self.backbone(x) + self.backbone(torch.flip(x, dims=[-1])))


def load_backbone(state: dict[str, Tensor], which: str, meta: dict, where: str) -> nn.Module:
    """The ``encoder_{which}.backbone`` weights of a MoCo ``state_dict`` in a fresh backbone."""
    pre = f"encoder_{which}.backbone."
    weights = {k[len(pre):]: v for k, v in state.items() if k.startswith(pre)}
    return build_encoder(weights, meta, pool_grid=GRID, where=f"{where} encoder_{which}")[0]


def embed_both(model: nn.Module, shards: Path) -> dict[str, FeatureSet]:
    """``{train,test}`` grid features and ``{train,test}_global`` (mean of the cells)."""
    out = {}
    for split in ("train", "test"):
        spec = image_spec(read_manifest(shards / split), shards / split)
        fs = extract_features(model, eval_loader(
            shards / split, transform=build_eval_transform(spec.size, spec.mean, spec.std),
            batch_size=512, num_workers=0), device="cpu", progress=False)
        out[split] = fs
        cells = fs.features.view(len(fs), -1, GRID * GRID)  # GridPool flattens (C, g, g)
        out[f"{split}_global"] = FeatureSet(cells.mean(-1).contiguous(), fs.labels, fs.keys)
    return out


def evaluate(f: dict[str, FeatureSet], seed: int, num_classes: int) -> dict[str, float]:
    """kNN (chosen on held-out TRAIN), the held-out linear probe, the MoCo-protocol kNN."""
    tr, te = f["train"], f["test"]
    sel, _ = select_on_heldout(tr.features, tr.labels, seed=seed)
    knn = knn_classify(tr.features, tr.labels, te.features, te.labels, k=sel.k, T=sel.T,
                       num_classes=num_classes)
    lin = train_linear_on_features(tr, te, val_fraction=0.1, seed=seed,
                                   num_classes=num_classes, feature_norm="l2")
    g_tr, g_te = f["train_global"], f["test_global"]
    proto = knn_classify(g_tr.features, g_tr.labels, g_te.features, g_te.labels, k=DEFAULT_K,
                         T=DEFAULT_T, num_classes=num_classes)
    return {"knn_val": round(sel.val_top1, 2), "knn_k": sel.k, "knn_T": sel.T,
            "knn_test": round(knn.top1, 2), "linear_val": round(lin.val_top1, 2),
            "linear_test_90": round(lin.top1, 2), "protocol_knn_test": round(proto.top1, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--encoder", type=Path, default=Path("models/encoder.pt"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = ap.parse_args()
    p = load_params(args.params)
    shards = Path(p.data.shards_dir)
    meta = json.loads(args.encoder.with_suffix(".json").read_text())
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)["model"]
    exported = torch.load(args.encoder, map_location="cpu", weights_only=True)
    num_classes = len(read_manifest(shards / "test").class_names)
    for which in ("q", "k"):
        backbone = load_backbone(state, which, meta, str(args.checkpoint))
        if which == "q":
            q = backbone.state_dict()
            if not all(torch.equal(q[k], v) for k, v in exported.items()):
                raise SystemExit(f"{args.checkpoint}'s query backbone is not {args.encoder}")
        for flip in (False, True):
            f = embed_both(FlipAverage(backbone) if flip else backbone, shards)
            if which == "q" and not flip:
                ref = load_features(Path("features/train_global.pt")).features
                if not torch.allclose(ref, f["train_global"].features, atol=1e-4):
                    raise SystemExit("the mean of the grid cells is not features/train_global.pt")
            row = {"encoder": {"q": "query", "k": "key"}[which], "flip_average": flip,
                   **evaluate(f, p.seed, num_classes)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
