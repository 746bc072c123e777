"""The approximate all-pairs searches against the exact ones: recall, pairs and time (issue 56).

The images: ``N`` Fashion-MNIST images replicated as in ``benchmarks/scale.py`` (seeded shifts
and flips, no exact duplicates), embedded by a trained encoder (default the default run's
``models/encoder.pt``) as ``data_insights`` embeds them: the eval transform of the train
split's normalisation, the last stage's global pool (the ``embedding`` view) and the first
stage's channel statistics (the ``low_level`` view). For each of the sizes given (subsets: the
first n rows), the same search run exactly (:func:`pipeline.evaluate.knn.self_neighbours` with
the threshold raised) and on the HNSW graph (the threshold at 0):

- time of each, and recall@k: the share of the exact ``k`` nearest others the approximate
  search returns (k = ``insights.neighbours``, 10);
- the near-duplicate pairs (cosine >= ``insights.duplicate_cosine``) of each: found by both,
  by the exact search only, by the approximate one only;
- at the largest size, the held-out search of ``knn.select: val`` (10 % of the rows against the
  other 90 %, k = 200) both ways: recall@200 (the pipeline scores at most 10,000, exactly).

    python benchmarks/ann_recall.py [--images 240000] [--sizes 60000 120000 240000]
        [--encoder models/encoder.pt] [--shards data/shards] [--out results/ann-recall.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def embed_replicas(n: int, encoder: Path, shards: Path, batch: int = 512
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(global (n, C), low_level (n, 2C'), labels (n,))`` of ``n`` replicated images."""
    from scale import replicas

    from pipeline.data.manifest import read_manifest
    from pipeline.data.shards import image_spec
    from pipeline.data.views import build_eval_transform
    from pipeline.evaluate.insights import channel_statistics
    from pipeline.evaluate.run.embed import Embedder

    spec = image_spec(read_manifest(shards / "train"), shards / "train")
    tf = build_eval_transform(spec.size, spec.mean, spec.std)
    embedder = Embedder(encoder, device=torch.device("cpu"))
    low: list[torch.Tensor] = []
    embedder.backbone.layer1.register_forward_hook(
        lambda mod, inp, out: low.append(channel_statistics(out)))

    def batches():
        images, labels, keys = [], [], []
        for s in replicas(n):
            images.append(tf(s.image))
            labels.append(s.label)
            keys.append(s.key)
            if len(images) == batch:
                yield torch.stack(images), torch.tensor(labels), keys
                images, labels, keys = [], [], []
        if images:
            yield torch.stack(images), torch.tensor(labels), keys

    _, g = embedder(batches(), desc="embed")
    return g.features, torch.cat(low), g.labels


def recall(exact: torch.Tensor, approx: torch.Tensor) -> float:
    """Mean share of each row's exact neighbours among its approximate ones."""
    k = exact.shape[1]
    hits = sum(len(set(a) & set(b)) for a, b in zip(exact.tolist(), approx.tolist()))
    return hits / (k * exact.shape[0])


def _search(features: torch.Tensor, k: int, exact: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                  float]:
    import pipeline.evaluate.ann as ann
    from pipeline.evaluate.knn import self_neighbours

    saved = ann.EXACT_SEARCH_MAX_PAIRS
    ann.EXACT_SEARCH_MAX_PAIRS = 10**18 if exact else 0
    try:
        t = time.perf_counter()
        sim, idx = self_neighbours(features, k=k)
        return sim, idx, time.perf_counter() - t
    finally:
        ann.EXACT_SEARCH_MAX_PAIRS = saved


def compare(features: torch.Tensor, k: int, duplicate_cosine: float | None) -> dict:
    """Exact vs HNSW self search of ``features``: time, recall@k, near-duplicate pairs.

    ``duplicate_cosine`` None: no pairs (the ``low_level`` view gives isolation only).
    """
    from pipeline.evaluate.insights import duplicate_pairs

    se, ie, te = _search(features, k, exact=True)
    sa, ia, ta = _search(features, k, exact=False)
    row = {"rows": len(features), "dims": features.shape[1], "k": k,
           "exact_s": round(te, 1), "hnsw_s": round(ta, 1), "speedup": round(te / ta, 2),
           f"recall_at_{k}": round(recall(ie, ia), 5)}
    if duplicate_cosine is None:
        return row
    pe = {tuple(p) for p in duplicate_pairs(se, ie, duplicate_cosine)[0].tolist()}
    pa = {tuple(p) for p in duplicate_pairs(sa, ia, duplicate_cosine)[0].tolist()}
    return {**row, "pairs_exact": len(pe), "pairs_hnsw": len(pa), "pairs_both": len(pe & pa),
            "pairs_exact_only": len(pe - pa), "pairs_hnsw_only": len(pa - pe)}


def heldout(features: torch.Tensor, labels: torch.Tensor, seed: int) -> dict:
    """The held-out search of ``knn.select: val`` (10 % of train against the rest), exact vs
    on an HNSW graph of the bank. The pipeline searches at most 10,000 held-out rows, exactly
    (:data:`pipeline.evaluate.heldout.KNN_SELECT_MAX_VAL`); this measures what a graph would
    have found for all of them."""
    import pipeline.evaluate.ann as ann
    from pipeline.evaluate.heldout import KNN_SELECT_VAL_FRACTION, split_train_val
    from pipeline.evaluate.knn import knn_neighbours
    from pipeline.evaluate.normalize import l2_normalize_rows

    tr, va = split_train_val(len(labels), KNN_SELECT_VAL_FRACTION, seed)
    out = {"bank": len(tr), "queries": len(va)}
    t = time.perf_counter()
    _, exact = knn_neighbours(features[tr], features[va], k=200)
    out["exact_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    index = ann.hnsw_index(l2_normalize_rows(features[tr], "cpu"))
    _, graph = ann.hnsw_neighbours(index, l2_normalize_rows(features[va], "cpu"), k=200)
    out["hnsw_s"] = round(time.perf_counter() - t, 1)
    out["recall_at_200"] = round(recall(exact, graph), 5)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=240_000)
    ap.add_argument("--sizes", type=int, nargs="+", default=[60_000, 120_000, 240_000])
    ap.add_argument("--encoder", type=Path, default=REPO / "models/encoder.pt")
    ap.add_argument("--shards", type=Path, default=REPO / "data/shards")
    ap.add_argument("--out", default="results/ann-recall.json")
    a = ap.parse_args()
    from pipeline.config import load_params

    p = load_params(REPO / "params.yaml")
    k, cos = p.insights.neighbours, p.insights.duplicate_cosine
    t = time.perf_counter()
    g, low, labels = embed_replicas(a.images, a.encoder, a.shards)
    result = {"images": a.images, "encoder": str(a.encoder), "threads": torch.get_num_threads(),
              "embed_s": round(time.perf_counter() - t, 1), "embedding": [], "low_level": []}
    print(f"embedded {a.images} images in {result['embed_s']} s", flush=True)
    for n in sorted(a.sizes):
        for view, x, c in (("embedding", g, cos), ("low_level", low, None)):
            row = compare(x[:n], k, c)
            result[view].append(row)
            print(view, json.dumps(row), flush=True)
            Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    result["select_val"] = heldout(g, labels, p.seed)
    print("select_val", json.dumps(result["select_val"]), flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
