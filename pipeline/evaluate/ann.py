"""Approximate nearest neighbours on a CPU for the all-pairs searches past a measured size.

An exact search of every image against every other costs ``N^2 D`` multiply-adds: on 2 cores,
256 dims, 13 s at 60,000 images, 53 s at 120,000, 210 s at 240,000 (x4 per doubling), where the
graph below takes 11, 30 and 71 s and finds 99.98 % of the exact 10 nearest others and every
one of the near-duplicate pairs (``benchmarks/ann_recall.py``,
results/ann-recall-2026-12-07.md). Past
:data:`EXACT_SEARCH_MAX_PAIRS` compared pairs, :func:`pipeline.evaluate.knn.self_neighbours`
(near-duplicates and outliers, and TypiClust's typicality within a cluster) uses a graph index
instead, on a CPU only: on a GPU it stays exact, blocked. The kNN classifier's test-set search
and the held-out search that chooses its k and T (at most 10,000 queries,
:data:`pipeline.evaluate.heldout.KNN_SELECT_MAX_VAL`) are linear in N and stay exact
everywhere.

The index: FAISS (``faiss-cpu`` from PyPI, Meta's library, maintained since 2017, the reference
of the ANN benchmarks) ``IndexHNSWFlat`` (Malkov & Yashunin, HNSW, TPAMI 2018) on the
L2-normalised rows with inner product, i.e. cosine. Chosen over an inverted file (IVF): it needs
no training and costs less up to millions of rows. Its cost grows faster than N log N at a fixed
ef (from 240,000 to 960,000 distinct 256-d rows, b 1.42 to build and 1.27 to search on 2
cores); an IVF of 1,000-row lists with 16 probed searches linearly (b 1.03) but took 326 s
against the graph's 215 s at 960,000 (``benchmarks/graph_growth.py``,
results/graph-growth-2026-12-08.md).
The graph is built on ONE thread, so the same rows give the same graph and the same neighbours
on any machine's core count (FAISS adds points on several threads in an order that depends on
their timing); the queries run on every thread (each query reads the fixed graph alone).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger(__name__)

# Above this many compared pairs (queries x bank rows) a CPU search is approximate. The graph
# is as fast as the exact search at 60,000 images (3.6e9 pairs) and 1.7x faster at 120,000
# (1.4e10); 10^10 pairs (100,000 images) are ~40 s of exact search at 256 dims on 2 cores
# (results/ann-recall-2026-12-07.md). Below it the exact answer costs little more, so the
# default run's 60,000-image searches stay exact.
EXACT_SEARCH_MAX_PAIRS = 10**10
HNSW_M = 32  # graph degree (FAISS' and the HNSW paper's usual 16-48); memory 8 * M B per row
HNSW_EF_CONSTRUCTION = 64  # candidates kept while building (FAISS' default 40; recall +)
# candidates kept while searching: max(HNSW_EF_SEARCH, 2 k); recall@10 at 240,000 images in
# results/ann-recall-2026-12-07.md
HNSW_EF_SEARCH = 64


def approximate(queries: int, bank: int, device: torch.device) -> bool:
    """Whether a search of ``queries`` x ``bank`` rows on ``device`` is approximate here.

    True on a CPU past :data:`EXACT_SEARCH_MAX_PAIRS` pairs; never on a GPU.
    """
    return device.type == "cpu" and queries * bank > EXACT_SEARCH_MAX_PAIRS


def _threads() -> int:
    return max(1, torch.get_num_threads())  # the stage's thread count (pipeline.runtime)


def hnsw_index(bank: Tensor) -> Any:
    """An HNSW graph of the bank's rows, built on one thread (the module docstring).

    The graph keeps its own copy of the rows (``4 N D`` bytes besides ``8 M N`` of links;
    :func:`pipeline.evaluate.knn.self_neighbours` passes a file-backed ``bank``, so that the two
    copies are not both anonymous memory):
    once this returns, the caller's ``bank`` can go (:func:`hnsw_neighbours` reads the rows
    back from the graph).

    Args:
        bank: (N, D) float32 CPU rows, L2-normalised (:func:`pipeline.evaluate.normalize.
            l2_normalize_rows`), memory-mapped or not: the graph copies them.

    Returns:
        A ``faiss.IndexHNSWFlat`` on inner product holding the N rows.
    """
    import faiss  # only past the threshold: the exact searches never load it

    x = np.ascontiguousarray(bank.numpy(), dtype=np.float32)  # (N, D), shares memory
    index = faiss.IndexHNSWFlat(x.shape[1], HNSW_M, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    before = faiss.omp_get_max_threads()
    try:
        faiss.omp_set_num_threads(1)  # a graph independent of the core count (module docstring)
        index.add(x)
    finally:
        faiss.omp_set_num_threads(before)
    return index


def _rows(index: Any) -> np.ndarray:
    """The (N, D) float32 rows an index holds, as a view of its memory (no copy)."""
    import faiss

    storage = faiss.downcast_index(index.storage)
    return faiss.rev_swig_ptr(storage.get_xb(), index.ntotal * index.d).reshape(
        index.ntotal, index.d)


def hnsw_neighbours(index: Any, queries: Tensor | None, *, k: int
                    ) -> tuple[Tensor, Tensor]:
    """The ``k`` most cosine-similar bank rows of every query by an HNSW graph (approximate).

    Args:
        index: :func:`hnsw_index` of the (N, D) bank.
        queries: (M, D) float32 CPU rows, L2-normalised; None: the bank itself (read from
            ``index``, no copy), each row's own entry left out (a self search).
        k: neighbours per query, ``1 <= k <= N`` (``N - 1`` for a self search).

    Returns:
        ``(similarities, indices)``: (M, k) float32 cosines sorted descending and (M, k) int64
        bank rows, on CPU. A query the graph gives fewer than ``k`` rows for (none was seen in
        the measurements) is searched exactly.
    """
    import faiss

    own = queries is None
    x = _rows(index)  # (N, D)
    q = x if own else np.ascontiguousarray(queries.numpy(), dtype=np.float32)  # (M, D)
    want = k + 1 if own else k
    before = faiss.omp_get_max_threads()
    try:
        faiss.omp_set_num_threads(_threads())
        index.hnsw.efSearch = max(HNSW_EF_SEARCH, 2 * want)
        sim, idx = index.search(q, want)  # (M, want) each, most similar first
    finally:
        faiss.omp_set_num_threads(before)
    sim, idx = torch.from_numpy(sim), torch.from_numpy(idx).long()
    if own:
        sim, idx = _drop_self(sim, idx)
    missing = (idx < 0).any(dim=1).nonzero().flatten()  # rows with fewer than k found
    if len(missing):
        log.warning("HNSW search: %d of %d queries found fewer than %d rows; searched exactly",
                    len(missing), len(q), k)
        sim[missing], idx[missing] = _exact(x, q[missing.numpy()], k,
                                            exclude=missing if own else None)
    return sim.float(), idx


def _drop_self(sim: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """(M, k + 1) results of the bank searched with itself -> (M, k) without each row's own.

    A row is usually its own first hit; where an exact copy ties it or the graph missed it,
    the row's own entry is dropped wherever it is, or else the last hit.
    """
    m, kk = idx.shape
    own = idx == torch.arange(m)[:, None]  # (M, k + 1)
    keep = ~own
    keep[own.sum(dim=1) == 0, kk - 1] = False  # own row not among the hits: drop the worst
    return sim[keep].view(m, kk - 1), idx[keep].view(m, kk - 1)


def _exact(x: np.ndarray, q: np.ndarray, k: int, exclude: Tensor | None
           ) -> tuple[Tensor, Tensor]:
    """Exact top-``k`` of queries ``q`` (r, D) in ``x`` (N, D), row ``exclude[i]`` left out."""
    bank, out_s, out_i = torch.from_numpy(x), [], []
    for r0 in range(0, len(q), 256):  # (256, N) fp32 blocks
        sim = torch.from_numpy(q[r0:r0 + 256]) @ bank.T
        if exclude is not None:
            sim[torch.arange(sim.shape[0]), exclude[r0:r0 + 256]] = float("-inf")
        s, i = sim.topk(k, dim=1)
        out_s.append(s)
        out_i.append(i)
    return torch.cat(out_s), torch.cat(out_i)
