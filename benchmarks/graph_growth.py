"""How the HNSW self search's time grows with N, with and without near copies (issue 56).

`data_insights`' graph search grew faster than N log N from 240,000 to 960,000 replicated
Fashion-MNIST images (b 1.41 on a Xeon, 1.21 for the whole stage on an EPYC). That set holds
N / 60,000 shifted copies of each image, so its near-duplicates grow with N (79, 423, 1,959
pairs at 60k, 120k, 240k: results/ann-recall-2026-12-07.md). This separates the two causes on
synthetic rows of the same shape, built and searched exactly as the stage does
(:func:`pipeline.evaluate.ann.hnsw_index` on one thread, :func:`pipeline.evaluate.ann.
hnsw_neighbours` on the stage's threads, k = ``insights.neighbours``):

- ``distinct``: N rows drawn independently: a seeded random map of a ``latent``-dimensional
  Gaussian mixture (``clusters`` centres) into ``dims`` dimensions, plus isotropic noise,
  L2-normalised: no two rows closer than the mixture makes them;
- ``copies``: ``base`` such rows, each repeated N / ``base`` times with a small seeded
  perturbation (``copy_noise``; at 0.1 two copies are at cosine ~0.99, a row's nearest
  distinct other at ~0.97): the replicated set's shape, near copies growing with N.

Per kind and size: build and search seconds, and the slope b of each between sizes.

    python benchmarks/graph_growth.py [--sizes 240000 960000] [--dims 256]
        [--kinds distinct copies] [--index hnsw|hnsw-fp16|ivf] [--out results/graph-growth.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def rows(n: int, dims: int, *, latent: int = 16, clusters: int = 100, seed: int = 0,
         noise: float = 0.05) -> torch.Tensor:
    """(n, dims) float32 L2-normalised rows of a seeded Gaussian mixture (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, latent, generator=g) * 3
    mix = torch.randn(latent, dims, generator=g) / math.sqrt(latent)
    out = torch.empty(n, dims)
    for s in range(0, n, 65_536):  # blocks: the (n, latent) draw stays small
        m = min(65_536, n - s)
        z = centres[torch.randint(clusters, (m,), generator=g)] + torch.randn(m, latent,
                                                                                generator=g)
        out[s:s + m] = z @ mix + noise * torch.randn(m, dims, generator=g)
    return torch.nn.functional.normalize(out, dim=1)


def copies(n: int, base: torch.Tensor, noise: float, seed: int = 1) -> torch.Tensor:
    """(n, D) rows: row i is ``base[i % len(base)]`` perturbed by ``noise`` per dimension."""
    g = torch.Generator().manual_seed(seed)
    out = base.repeat(math.ceil(n / len(base)), 1)[:n]
    out += noise * torch.randn(out.shape, generator=g) / math.sqrt(base.shape[1])
    return torch.nn.functional.normalize(out, dim=1)


def _build(x: torch.Tensor, index: str, list_rows: int):
    """The index of ``x`` (N, D), its rows added on ONE thread as the pipeline's graph is.

    ``hnsw``: :func:`pipeline.evaluate.ann.hnsw_index`; ``hnsw-fp16``: the same graph with fp16
    rows (``IndexHNSWSQ``, ``QT_fp16``: half the bytes per row); ``ivf``: an inverted file of
    N / ``list_rows`` k-means lists (``IndexIVFFlat``), each query scanning a fixed number of
    lists (:data:`IVF_PROBE`), so its cost does not grow with N but the lists' assignment does.
    """
    import faiss
    import numpy as np

    from pipeline.evaluate.ann import HNSW_EF_CONSTRUCTION, HNSW_M, hnsw_index

    if index == "hnsw":
        return hnsw_index(x)
    v = np.ascontiguousarray(x.numpy())
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        if index == "hnsw-fp16":
            out = faiss.IndexHNSWSQ(v.shape[1], faiss.ScalarQuantizer.QT_fp16, HNSW_M,
                                    faiss.METRIC_INNER_PRODUCT)
            out.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        else:
            quantizer = faiss.IndexFlatIP(v.shape[1])
            out = faiss.IndexIVFFlat(quantizer, v.shape[1], max(1, len(v) // list_rows),
                                     faiss.METRIC_INNER_PRODUCT)
            out.cp.seed = 0
        out.train(v)
        out.add(v)
    finally:
        faiss.omp_set_num_threads(before)
    return out


IVF_PROBE = 16  # lists scanned per query


def _recall(index, x: torch.Tensor, k: int, queries: int = 2_000) -> float:
    """Recall@k of the self search on ``queries`` seeded rows, against the exact search."""
    import numpy as np

    q = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:queries]
    from ann_recall import recall

    exact = (x[q] @ x.T).topk(k + 1, dim=1).indices[:, 1:]  # (Q, k), own row first
    _, found = index.search(np.ascontiguousarray(x[q].numpy()), k + 1)  # (Q, k + 1)
    others = torch.tensor([[j for j in row if j != i][:k]  # each row's own entry left out
                           for row, i in zip(found.tolist(), q.tolist())])
    return round(recall(exact, others), 4)


def time_graph(x: torch.Tensor, k: int, index: str = "hnsw", list_rows: int = 1_000) -> dict:
    """Seconds to build the index of ``x`` and to search it with every row (k others each),
    and recall@k (:func:`_recall`)."""
    from pipeline.evaluate.ann import HNSW_EF_SEARCH, hnsw_neighbours

    t = time.perf_counter()
    built_index = _build(x, index, list_rows)
    built = time.perf_counter() - t
    t = time.perf_counter()
    if index == "hnsw":
        hnsw_neighbours(built_index, None, k=k)
    else:
        if index == "ivf":
            built_index.nprobe = IVF_PROBE
        else:
            built_index.hnsw.efSearch = max(HNSW_EF_SEARCH, 2 * (k + 1))
        built_index.search(x.numpy(), k + 1)
    searched = time.perf_counter() - t
    return {"rows": len(x), "build_s": round(built, 1), "search_s": round(searched, 1),
            f"recall_at_{k}": _recall(built_index, x, k)}


def slopes(runs: list[dict]) -> dict:
    """b = d log(time) / d log(N) of build and search between consecutive sizes."""
    out = {}
    for a, b in zip(runs, runs[1:]):
        r = math.log(b["rows"] / a["rows"])
        out[f"{a['rows']}->{b['rows']}"] = {  # None: a time below the 0.1 s resolution
            p: round(math.log(b[f"{p}_s"] / a[f"{p}_s"]) / r, 2)
            if min(a[f"{p}_s"], b[f"{p}_s"]) > 0 else None for p in ("build", "search")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[240_000, 960_000])
    ap.add_argument("--dims", type=int, default=256)  # data_insights' embedding view
    ap.add_argument("--base", type=int, default=60_000)  # Fashion-MNIST's training images
    ap.add_argument("--copy-noise", type=float, default=0.1)  # copies at cosine ~0.99
    ap.add_argument("--kinds", nargs="+", default=["distinct", "copies"])
    ap.add_argument("--index", choices=["hnsw", "hnsw-fp16", "ivf"], default="hnsw")
    ap.add_argument("--list-rows", type=int, default=1_000)  # ivf: rows per list
    ap.add_argument("--out", default="results/graph-growth.json")
    a = ap.parse_args()
    from pipeline.config import load_params

    k = load_params(REPO / "params.yaml").insights.neighbours
    result = {"cpu": platform.processor() or platform.machine(), "threads":
              torch.get_num_threads(), "dims": a.dims, "k": k, "base": a.base,
              "copy_noise": a.copy_noise, "index": a.index,
              "transparent_hugepage": Path("/sys/kernel/mm/transparent_hugepage/enabled")
              .read_text().strip()}
    base = rows(a.base, a.dims, seed=0)
    for kind in a.kinds:
        runs = []
        for n in sorted(a.sizes):
            x = rows(n, a.dims, seed=0) if kind == "distinct" else copies(n, base, a.copy_noise)
            runs.append(time_graph(x, k, a.index, a.list_rows))
            del x
            print(kind, json.dumps(runs[-1]), flush=True)
        result[kind] = {"runs": runs, "b": slopes(runs)}
        print(kind, json.dumps(result[kind]["b"]), flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
