"""Weighted k-nearest-neighbour classifier on frozen features (InstDisc protocol).

The protocol of Wu et al. 2018 (InstDisc), as used by the MoCo CIFAR-10 demo's kNN monitor:
features are L2-normalised (:func:`pipeline.evaluate.normalize.l2_normalize`: scaled before
the norm, so a finite row of any magnitude keeps its direction), each test image takes its
``k`` most cosine-similar images of the train bank, neighbour ``i`` votes for its label with
weight ``exp(s_i / T)``, and the class with the largest summed vote wins. Defaults k=200,
T=0.1 as in InstDisc / the MoCo CIFAR demo.

Memory is bounded independently of the bank size: the bank is processed in chunks of
``bank_chunk_size`` rows and a running top-k is merged across chunks, the test set in chunks of
``chunk_size`` rows. See :func:`knn_predict` for the bound. This search
(:func:`knn_neighbours`, the block merge of :class:`_RunningTopK`) is the code base's one
neighbour search: :func:`self_neighbours` runs it with one set as bank and queries (the
near-duplicates and outliers of :mod:`pipeline.evaluate.insights`), the report's retrieval
figure calls it too. The all-pairs search (:func:`self_neighbours`) runs on an HNSW graph
instead past :data:`pipeline.evaluate.ann.EXACT_SEARCH_MAX_PAIRS` compared pairs on a CPU
(:mod:`pipeline.evaluate.ann`); the classifier's test-set search and the held-out search of
:func:`select_k_T` (at most 10,000 queries) are linear in N and always exact.

The top-1/top-5/per-class/confusion summary is :mod:`pipeline.evaluate.metrics`, shared with the
linear probe, and so is the rule for unlabelled rows: label -1 rows are ignored (left out of the
bank and of the test set) with a logged count; any other label outside ``0..num_classes-1`` is
refused, naming the value.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pipeline.errors import InputError
from pipeline.evaluate.ann import approximate, hnsw_index, hnsw_neighbours
from pipeline.evaluate.features import file_backed
from pipeline.evaluate.heldout import (
    KNN_SELECT_MAX_VAL,
    KNN_SELECT_VAL_FRACTION,
    split_train_val,
)
from pipeline.evaluate.metrics import (
    ClassificationMetrics,
    classification_metrics,
    contiguous_labels,
    labelled_mask,
)
from pipeline.evaluate.normalize import l2_normalize_rows

log = logging.getLogger(__name__)

DEFAULT_K = 200  # InstDisc / MoCo CIFAR demo
DEFAULT_T = 0.1  # InstDisc / MoCo CIFAR demo
DEFAULT_BANK_CHUNK_SIZE = 65536  # bank rows per similarity block
# rows per side of a self_neighbours block: 2048 x 2048 fp32 = 16 MiB. CPU time at 12,000 x 256,
# k 10, one thread: 1024 -> 1.1 s, 2048 -> 0.97 s, 4096 -> 1.15 s
# (results/near-duplicates-2026-12-06.md)
DEFAULT_SELF_BLOCK_SIZE = 2048
# The grid of select_k_T (the raw-pixel baseline): k from 1-NN to the protocol's 200, T from
# nearly hard votes (0.02: the nearest neighbour dominates) to nearly uniform ones (1.0).
GRID_K = (1, 3, 5, 10, 20, 50, 100, 200)
GRID_T = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _check_inputs(train_features: Tensor, train_labels: Tensor, test_features: Tensor,
                  k: int, T: float, chunk_size: int, bank_chunk_size: int) -> None:
    if train_features.ndim != 2 or test_features.ndim != 2:
        raise InputError(
            f"features must be 2-D (N, D) and (M, D), got {tuple(train_features.shape)} and "
            f"{tuple(test_features.shape)}"
        )
    if train_features.shape[1] != test_features.shape[1]:
        raise InputError(
            f"feature dimension differs: train D = {train_features.shape[1]}, "
            f"test D = {test_features.shape[1]}"
        )
    if train_features.shape[0] == 0:
        raise InputError("the train bank is empty (N = 0)")
    if train_labels.shape != (train_features.shape[0],):
        raise InputError(
            f"train_labels must have shape (N,) = ({train_features.shape[0]},), "
            f"got {tuple(train_labels.shape)}"
        )
    if train_labels.dtype.is_floating_point or train_labels.dtype == torch.bool:
        raise InputError(f"train_labels must be integer class indices, got {train_labels.dtype}")
    for name, v in (("k", k), ("chunk_size", chunk_size), ("bank_chunk_size", bank_chunk_size)):
        if int(v) != v or v < 1:
            raise InputError(f"knn: '{name}' = {v!r} is invalid; allowed: an integer >= 1")
    if not (T > 0 and np.isfinite(T)):
        raise InputError(f"knn: 'T' = {T!r} is invalid; allowed: a finite number > 0")


@torch.no_grad()
def knn_predict(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    *,
    k: int = DEFAULT_K,
    T: float = DEFAULT_T,
    num_classes: int | None = None,
    chunk_size: int = 1024,
    bank_chunk_size: int = DEFAULT_BANK_CHUNK_SIZE,
    device: torch.device | str | None = None,
) -> Tensor:
    """Weighted kNN class scores (InstDisc; k=200, T=0.1 as in InstDisc / the MoCo CIFAR demo).

    Both feature sets are L2-normalised here (cosine similarity ``s``). Each test row takes its
    ``min(k, N)`` most similar bank rows; neighbour ``i`` votes for its class with weight
    ``exp(s_i / T)``. The returned score of a class is its share of the total vote,
    ``sum_{i in class} exp(s_i/T) / sum_i exp(s_i/T)`` (computed as a softmax over the
    neighbours, so it cannot overflow for small ``T``); it ranks classes exactly like the raw
    InstDisc vote sum. Rows sum to 1.

    Labels here are class INDICES in ``[0, num_classes)``; for arbitrary label values (e.g.
    {3, 7, 42}) use :func:`knn_classify`, which maps them to contiguous indices and back. Bank
    rows labelled -1 (unlabelled) are ignored, with a logged count: they never vote.

    Memory: the bank is processed in blocks of ``bank_chunk_size`` rows (each moved to ``device``
    and normalised once) and the test set in blocks of ``chunk_size`` rows. Peak extra memory on
    ``device`` is about ``4 * chunk_size * bank_chunk_size`` bytes (one fp32 similarity block; the
    top-k of a block adds a small fraction) + ``4 * D * (bank_chunk_size + M)`` (normalised bank
    block and test features) + ``12 * M * min(k, N)`` (running top-k values fp32 + indices int64)
    + ``4 * M * C`` (the scores). With the defaults (1024 x 65536) a similarity block is 256 MiB,
    whatever the bank size (1.28 M images included).

    Which neighbours are kept when several bank rows have exactly the same similarity at the
    k-th place is decided by ``torch.topk`` and may depend on the chunking; votes never depend
    on bank order otherwise.

    Args:
        train_features: (N, D) bank features (any float dtype; computed in fp32).
        train_labels: (N,) int64 class indices of the bank, in ``[0, num_classes)``; -1 marks
            an unlabelled row (ignored).
        test_features: (M, D) query features; M = 0 gives an empty (0, C) result.
        k: neighbours per query; ``min(k, N)`` are used when the bank is smaller.
        T: temperature of the vote weights ``exp(s / T)`` (> 0).
        num_classes: C; default the largest bank label + 1.
        chunk_size: test rows per similarity block (``knn.chunk_size``).
        bank_chunk_size: bank rows per similarity block.
        device: where to compute; default the device of ``test_features``. Inputs may live on
            another device (e.g. a CPU bank with CUDA compute): blocks are moved as needed.

    Returns:
        (M, C) float32 class scores on ``device``.

    Raises:
        ValueError: wrong shapes or dtypes, an empty bank (or one without a labelled row), k / T /
            chunk sizes out of range, or a label outside ``[0, num_classes)`` other than -1 (the
            value is named).
    """
    _check_inputs(train_features, train_labels, test_features, k, T, chunk_size, bank_chunk_size)
    train_features, train_labels = _labelled_bank(train_features, train_labels, num_classes)
    device = torch.device(device) if device is not None else test_features.device
    n, m = train_features.shape[0], test_features.shape[0]
    c = int(train_labels.max()) + 1 if num_classes is None else int(num_classes)
    k_eff = min(int(k), n)
    if k_eff < k:
        log.warning("kNN: k = %d exceeds the %d labelled bank rows; voting over all %d", k, n, n)
    if m == 0:
        return torch.zeros(0, c, device=device)

    top_sim, top_idx = knn_neighbours(train_features, test_features, k=k_eff,
                                      chunk_size=chunk_size, bank_chunk_size=bank_chunk_size,
                                      device=device)
    return _vote(top_sim, top_idx, train_labels.to(device, torch.long), T=T, num_classes=c,
                 chunk_size=chunk_size)


@torch.no_grad()
def knn_neighbours(
    bank_features: Tensor,
    query_features: Tensor,
    *,
    k: int,
    chunk_size: int = 1024,
    bank_chunk_size: int = DEFAULT_BANK_CHUNK_SIZE,
    device: torch.device | str | None = None,
    bank_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``k`` most cosine-similar bank rows of every query, most similar first.

    The one neighbour search of the code base (the kNN classifier, the report's retrieval
    figure, and, through :func:`self_neighbours`, the near-duplicates and outliers of the
    pretraining images): a running top-k per query merged over bank blocks, never an (M, N)
    matrix.

    Args:
        bank_features: (N, D) bank, N >= k (any float dtype; computed in fp32, L2-normalised here).
        query_features: (M, D) queries.
        k: neighbours per query, ``1 <= k <= N``.
        chunk_size: query rows per similarity block.
        bank_chunk_size: bank rows per similarity block (memory: see :func:`knn_predict`).
        device: where to compute; default the device of ``query_features``.
        bank_rows: (N',) int64 rows of ``bank_features`` that are the bank (e.g. the train rows
            not held out), read block by block, so the subset is never copied whole; None: every
            row. Indices returned are positions in ``bank_rows``.

    Returns:
        ``(similarities, indices)``: (M, k) float32 cosine similarities sorted descending and
        (M, k) int64 bank row indices, on ``device``. The first ``k'`` columns are the top-``k'``
        for any ``k' <= k`` (up to ties at the boundary), so one call serves a whole k grid.

    Raises:
        ValueError: NaN or Inf in either feature set.
    """
    device = torch.device(device) if device is not None else query_features.device
    queries = l2_normalize_rows(query_features, device,
                                error="test_features contain NaN or Inf")  # M x D
    n_bank = bank_features.shape[0] if bank_rows is None else len(bank_rows)
    top = _RunningTopK(queries.shape[0], k, device)
    for b0 in range(0, n_bank, bank_chunk_size):
        b1 = min(b0 + bank_chunk_size, n_bank)
        bank = bank_features[b0:b1] if bank_rows is None else bank_features[bank_rows[b0:b1]]
        bank = l2_normalize_rows(bank, device, error=f"train_features contain NaN or Inf "
                                 f"(rows {b0}..{b1 - 1})")  # B x D
        for q0 in range(0, queries.shape[0], chunk_size):
            top.merge(q0, queries[q0 : q0 + chunk_size] @ bank.T, b0)  # chunk x B
    return top.sim, top.idx


@torch.no_grad()
def self_neighbours(
    features: Tensor,
    *,
    k: int,
    block_size: int = DEFAULT_SELF_BLOCK_SIZE,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``k`` most cosine-similar OTHER rows of every row of one set, most similar first.

    The search of :func:`knn_neighbours` with the set as both bank and queries, each row's own
    entry left out, and each similarity block computed once: block ``(I, J)`` of ``X X^T``
    updates the running top-k of the rows of ``I`` and, transposed, of ``J``, so only the
    blocks on and above the diagonal are multiplied (half the work of two separate sets).

    Past :data:`pipeline.evaluate.ann.EXACT_SEARCH_MAX_PAIRS` (``N^2``) on a CPU the search
    runs on an HNSW graph instead (:func:`pipeline.evaluate.ann.hnsw_neighbours`: approximate,
    recall@10 in results/ann-recall-2026-12-07.md); on a GPU it stays exact.

    Memory: the L2-normalised copy of ``features`` (``4 N D`` bytes), two ``block_size x
    block_size`` fp32 blocks (a block and its transposed copy: 32 MiB at the default 2048) and
    the running top-k (``12 N k`` bytes): linear in N, never an (N, N) matrix
    (``benchmarks/near_duplicates.py``: 60,000 x 256 adds ~0.1 GB, where the (N, N) fp32 matrix
    would be 14.4 GB).

    Args:
        features: (N, D) rows (any float dtype; computed in fp32, L2-normalised here).
        k: neighbours per row, ``1 <= k <= N - 1``.
        block_size: rows per similarity block on each side (default
            :data:`DEFAULT_SELF_BLOCK_SIZE`, from ``benchmarks/near_duplicates.py``).
        device: where to compute; default the device of ``features``.

    Returns:
        ``(similarities, indices)``: (N, k) float32 cosines sorted descending and (N, k) int64
        row indices (never the row itself), on ``device``.

    Raises:
        ValueError: fewer than ``k + 1`` rows, ``k`` or ``block_size`` below 1, or NaN / Inf
            in ``features``.
    """
    n = features.shape[0]
    for name, v in (("k", k), ("block_size", block_size)):
        if int(v) != v or v < 1:
            raise InputError(f"self_neighbours: '{name}' = {v!r} is invalid; allowed: an "
                             "integer >= 1")
    if n < k + 1:
        raise InputError(f"self_neighbours: {n} rows cannot give k = {k} other rows each")
    device = torch.device(device) if device is not None else features.device
    error = "self_neighbours: features contain NaN or Inf"
    if approximate(n, n, device):  # the graph holds the normalised rows, read back
        return hnsw_neighbours(hnsw_index(l2_normalize_rows(  # the graph copies the file's rows
            features, device, error=error, out=file_backed(None, n, features.shape[1]))),
            None, k=k)
    x = l2_normalize_rows(features, device, error=error)  # N x D
    top = _RunningTopK(n, k, device)
    for b0 in range(0, n, block_size):
        for q0 in range(0, b0 + 1, block_size):  # blocks on and above the diagonal
            sim = x[q0 : q0 + block_size] @ x[b0 : b0 + block_size].T  # bq x bb
            if q0 == b0:
                sim.fill_diagonal_(float("-inf"))  # a row is not its own neighbour
            top.merge(q0, sim, b0)
            if q0 != b0:
                top.merge(b0, sim.T.contiguous(), q0)  # the mirrored block: bb x bq
    return top.sim, top.idx


class _RunningTopK:
    """The best ``k`` (similarity, column) of each of ``m`` rows over the blocks seen so far.

    Slots start at -inf and are filled by the first blocks (a search sees at least ``k``
    finite candidates per row, so none survives the last merge).
    """

    def __init__(self, m: int, k: int, device: torch.device) -> None:
        self.k = k
        self.sim = torch.full((m, k), float("-inf"), device=device)  # M x k
        self.idx = torch.zeros(m, k, dtype=torch.long, device=device)  # M x k, columns

    def merge(self, row0: int, sim: Tensor, col0: int) -> None:
        """Merge a block: ``sim`` (r, c) holds rows ``row0..row0+r-1``, columns from ``col0``."""
        rows = slice(row0, row0 + sim.shape[0])
        s, i = sim.topk(min(self.k, sim.shape[1]), dim=1)  # r x kb
        s = torch.cat([self.sim[rows], s], dim=1)  # r x (k + kb)
        i = torch.cat([self.idx[rows], i + col0], dim=1)
        s, j = s.topk(self.k, dim=1)  # r x k
        self.sim[rows] = s
        self.idx[rows] = i.gather(1, j)


def _vote(top_sim: Tensor, top_idx: Tensor, labels: Tensor, *, T: float, num_classes: int,
          chunk_size: int = 1024) -> Tensor:
    """(M, C) vote shares of the neighbours ``(M, k)`` (weights ``exp(s/T)``, rows sum to 1)."""
    m = top_sim.shape[0]
    scores = torch.zeros(m, num_classes, device=top_sim.device)
    for q0 in range(0, m, chunk_size):
        weight = torch.softmax(top_sim[q0 : q0 + chunk_size] / T, dim=1)  # chunk x k, exp(s/T)/sum
        votes = labels[top_idx[q0 : q0 + chunk_size]]  # chunk x k
        scores[q0 : q0 + chunk_size].scatter_add_(1, votes, weight)  # chunk x C
    return scores


def _labelled_rows(labels: Tensor, num_classes: int | None) -> Tensor | None:
    """The (N',) positions of the bank's labelled rows, or None when every row is labelled.

    Raises:
        ValueError: a label outside ``-1..num_classes-1`` (named), or no labelled row.
    """
    keep = labelled_mask(labels, what="knn: train_labels", num_classes=num_classes)
    if bool(keep.all()):
        return None
    if not bool(keep.any()):
        raise InputError(f"knn: the train bank has no labelled row (all {len(labels)} are -1)")
    return keep.nonzero().flatten()


def _labelled_bank(features: Tensor, labels: Tensor, num_classes: int | None
                   ) -> tuple[Tensor, Tensor]:
    """The bank without its unlabelled (-1) rows (:func:`_labelled_rows`)."""
    rows = _labelled_rows(labels, num_classes)
    if rows is None:
        return features, labels  # no copy of a large bank
    return features[rows.to(features.device)], labels[rows]


@dataclass
class KnnResult(ClassificationMetrics):
    """kNN accuracy on a test set (see :class:`ClassificationMetrics`) plus the settings used.

    Attributes:
        k: the requested number of neighbours.
        k_used: ``min(k, N)``, the number actually used.
        T: the vote temperature.
    """

    k: int = DEFAULT_K
    k_used: int = DEFAULT_K
    T: float = DEFAULT_T


def knn_classify(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    *,
    k: int = DEFAULT_K,
    T: float = DEFAULT_T,
    num_classes: int | None = None,
    chunk_size: int = 1024,
    bank_chunk_size: int = DEFAULT_BANK_CHUNK_SIZE,
    device: torch.device | str | None = None,
) -> KnnResult:
    """Weighted kNN accuracy of a test set against a train bank (InstDisc, MoCo CIFAR demo).

    Labels may be any integers (e.g. {3, 7, 42}): the class set is the sorted union of train and
    test label values, mapped to contiguous indices for :func:`knn_predict` and back for the
    predictions. A class that occurs only in the test set can never be predicted (it still counts
    in the accuracy and the confusion matrix). Ties between classes with equal votes go to the
    lowest label value (stable ranking, see :func:`classification_metrics`).

    Unlabelled rows (label -1) are ignored, with a logged count: they neither vote in the bank
    nor count in the accuracy (the result describes the labelled test rows only). Any other
    negative label, or one ``>= num_classes`` when that is given, is refused.

    Args:
        train_features: (N, D) bank features.
        train_labels: (N,) integer labels of the bank (-1 = unlabelled, ignored).
        test_features: (M, D) query features, M >= 1.
        test_labels: (M,) integer labels of the queries (-1 = unlabelled, ignored).
        k: neighbours per query (k=200 as in InstDisc / the MoCo CIFAR demo); ``min(k, N)`` of
            the N labelled bank rows are used.
        T: vote temperature (T=0.1 as in InstDisc / the MoCo CIFAR demo).
        num_classes: C when known (e.g. the manifest's class count): labels must then lie in
            ``0..C-1`` (or be -1). It only checks; the classes of the result are still the label
            values that occur.
        chunk_size: test rows per similarity block (``knn.chunk_size``).
        bank_chunk_size: bank rows per similarity block (memory bound: see :func:`knn_predict`).
        device: compute device; default the device of ``test_features``.

    Returns:
        :class:`KnnResult` of the labelled test rows: top-1 / top-5 in percent (top-5 is
        top-min(5, C)), per-class accuracy, confusion matrix, predictions as label values.

    Raises:
        ValueError: shapes or dtypes do not match, an empty bank or test set (or one without a
            labelled row), an invalid label (named), or k / T / chunk sizes out of range.
    """
    if test_labels.shape != (test_features.shape[0],):
        raise InputError(
            f"test_labels must have shape (M,) = ({test_features.shape[0]},), "
            f"got {tuple(test_labels.shape)}"
        )
    _check_inputs(train_features, train_labels, test_features, k, T, chunk_size, bank_chunk_size)
    train_features, train_labels = _labelled_bank(train_features, train_labels, num_classes)
    keep = labelled_mask(test_labels, what="knn: test_labels", num_classes=num_classes)
    if not bool(keep.all()):
        test_features, test_labels = test_features[keep.to(test_features.device)], test_labels[keep]
    if test_features.shape[0] == 0:
        raise InputError("cannot compute kNN accuracy on an empty test set (M = 0 labelled rows)")
    classes, (train_idx, test_idx) = contiguous_labels(train_labels, test_labels)
    scores = knn_predict(
        train_features, train_idx, test_features, k=k, T=T, num_classes=len(classes),
        chunk_size=chunk_size, bank_chunk_size=bank_chunk_size, device=device,
    )
    base = classification_metrics(scores, test_idx, classes)
    return KnnResult(**vars(base), k=int(k), k_used=min(int(k), train_features.shape[0]), T=T)


@dataclass
class KnnSelection:
    """The (k, T) of a grid with the best validation top-1, and the whole grid's scores.

    Attributes:
        k: chosen number of neighbours.
        T: chosen vote temperature.
        val_top1: its validation top-1 (%).
        grid: ``{(k, T): validation top-1 %}`` for every grid point.
    """

    k: int
    T: float
    val_top1: float
    grid: dict[tuple[int, float], float]


@torch.no_grad()
def select_k_T(
    bank_features: Tensor,
    bank_labels: Tensor,
    val_features: Tensor,
    val_labels: Tensor,
    *,
    ks: tuple[int, ...] = GRID_K,
    Ts: tuple[float, ...] = GRID_T,
    chunk_size: int = 1024,
    device: torch.device | str | None = None,
    bank_rows: Tensor | None = None,
) -> KnnSelection:
    """Choose the kNN ``k`` and ``T`` on a validation split (never on the test set).

    The neighbours are searched once for ``max(ks)`` and every grid point is voted from their
    prefix, so the grid costs one exact similarity pass (M x N pairs: linear in N for the at
    most :data:`~pipeline.evaluate.heldout.KNN_SELECT_MAX_VAL` queries of
    :func:`select_on_heldout`). Ties in validation top-1 go to the earlier grid point (smaller
    k, then smaller T).

    Args:
        bank_features: (N, D) features of the bank (the train rows NOT held out).
        bank_labels: (N,) class indices in ``[0, C)``; -1 rows are ignored.
        val_features: (M, D) held-out train features.
        val_labels: (M,) their class indices (-1 rows ignored).
        ks: candidate k values (each >= 1; those above the labelled bank size are dropped).
        Ts: candidate temperatures (each > 0).
        chunk_size: query rows per similarity block.
        device: compute device; default the device of ``val_features``.
        bank_rows: (N',) int64 rows of ``bank_features`` and ``bank_labels`` that are the bank,
            read in blocks (:func:`knn_neighbours`: no copy of the subset); None: every row.

    Returns:
        :class:`KnnSelection`.

    Raises:
        ValueError: empty or mismatched inputs, an empty grid, or invalid labels (named).
    """
    if not ks or not Ts:
        raise InputError("knn: the (k, T) grid is empty")
    _check_inputs(bank_features, bank_labels, val_features, max(ks), min(Ts), chunk_size,
                  DEFAULT_BANK_CHUNK_SIZE)
    rows = torch.arange(len(bank_labels)) if bank_rows is None else bank_rows
    labelled = _labelled_rows(bank_labels[rows], None)
    if labelled is not None:
        rows = bank_rows = rows[labelled]  # the labelled bank rows, never copied
    bank_labels = bank_labels[rows]
    keep = labelled_mask(val_labels, what="knn: val_labels", num_classes=None)
    val_features, val_labels = val_features[keep.to(val_features.device)], val_labels[keep]
    if val_features.shape[0] == 0:
        raise InputError("knn: the validation split has no labelled row")
    ks = tuple(k for k in ks if k <= len(rows)) or (len(rows),)
    classes, (bank_idx, val_idx) = contiguous_labels(bank_labels, val_labels)
    sim, idx = knn_neighbours(bank_features, val_features, k=max(ks), chunk_size=chunk_size,
                              device=device, bank_rows=bank_rows)
    labels = bank_idx.to(sim.device, torch.long)
    truth = val_idx.to(sim.device)
    grid: dict[tuple[int, float], float] = {}
    for k in ks:
        for t in Ts:
            pred = _vote(sim[:, :k], idx[:, :k], labels, T=t, num_classes=len(classes),
                         chunk_size=chunk_size).argmax(dim=1)
            grid[(int(k), float(t))] = 100.0 * float((pred == truth).float().mean())
    (k, t), best = max(grid.items(), key=lambda kv: kv[1])  # max keeps the first of equals
    return KnnSelection(k=k, T=t, val_top1=best, grid=grid)


def select_on_heldout(features: Tensor, labels: Tensor, *, seed: int, chunk_size: int = 1024,
                      device: torch.device | str | None = None) -> tuple[KnnSelection, int]:
    """Choose k and T on ``KNN_SELECT_VAL_FRACTION`` of a TRAIN bank, the rest as the bank.

    The one selection protocol of the tuned raw-pixel kNN and of ``knn.select: val``: the split
    is :func:`pipeline.evaluate.heldout.split_train_val` with ``seed``, the grid that of
    :func:`select_k_T`. Past :data:`~pipeline.evaluate.heldout.KNN_SELECT_MAX_VAL` held-out
    rows (100,000 train images), that many of them, drawn with ``seed``, are scored; the bank
    stays the rows not held out.

    Args:
        features: ``(N, D)`` TRAIN features.
        labels: ``(N,)`` their labels.
        seed: the split's seed.
        chunk_size: query rows per similarity chunk.
        device: where to compute.

    Returns:
        The selection and the number of held-out rows.
    """
    tr, va = split_train_val(len(labels), KNN_SELECT_VAL_FRACTION, seed)
    if len(va) > KNN_SELECT_MAX_VAL:
        pick = torch.randperm(len(va), generator=torch.Generator().manual_seed(seed))
        va = va[pick[:KNN_SELECT_MAX_VAL].sort().values]
    sel = select_k_T(features, labels, features[va], labels[va], chunk_size=chunk_size,
                     device=device, bank_rows=tr)  # the bank read by row, never copied
    return sel, len(va)
