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
        [--out results/graph-growth.json]
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


def time_graph(x: torch.Tensor, k: int) -> dict:
    """Seconds to build the graph of ``x`` and to search it with every row (k others each)."""
    from pipeline.evaluate.ann import hnsw_index, hnsw_neighbours

    t = time.perf_counter()
    index = hnsw_index(x)
    built = time.perf_counter() - t
    t = time.perf_counter()
    hnsw_neighbours(index, None, k=k)
    return {"rows": len(x), "build_s": round(built, 1),
            "search_s": round(time.perf_counter() - t, 1)}


def slopes(runs: list[dict]) -> dict:
    """b = d log(time) / d log(N) of build and search between consecutive sizes."""
    out = {}
    for a, b in zip(runs, runs[1:]):
        r = math.log(b["rows"] / a["rows"])
        out[f"{a['rows']}->{b['rows']}"] = {
            p: round(math.log(b[f"{p}_s"] / a[f"{p}_s"]) / r, 2) for p in ("build", "search")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[240_000, 960_000])
    ap.add_argument("--dims", type=int, default=256)  # data_insights' embedding view
    ap.add_argument("--base", type=int, default=60_000)  # Fashion-MNIST's training images
    ap.add_argument("--copy-noise", type=float, default=0.1)  # copies at cosine ~0.99
    ap.add_argument("--kinds", nargs="+", default=["distinct", "copies"])
    ap.add_argument("--out", default="results/graph-growth.json")
    a = ap.parse_args()
    from pipeline.config import load_params

    k = load_params(REPO / "params.yaml").insights.neighbours
    result = {"cpu": platform.processor() or platform.machine(), "threads":
              torch.get_num_threads(), "dims": a.dims, "k": k, "base": a.base,
              "copy_noise": a.copy_noise}
    base = rows(a.base, a.dims, seed=0)
    for kind in a.kinds:
        runs = []
        for n in sorted(a.sizes):
            x = rows(n, a.dims, seed=0) if kind == "distinct" else copies(n, base, a.copy_noise)
            runs.append(time_graph(x, k))
            del x
            print(kind, json.dumps(runs[-1]), flush=True)
        result[kind] = {"runs": runs, "b": slopes(runs)}
        print(kind, json.dumps(result[kind]["b"]), flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
