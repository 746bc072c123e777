"""Report figures: each function draws one PNG, writes it to ``path`` and returns ``path``.

Functions take plain data (columns of a TSV as arrays, feature matrices, images), never file
paths of inputs, so they can be tested on synthetic values. Reading the pipeline's outputs is
the job of :mod:`pipeline.report.inputs`; :mod:`pipeline.report.sections` calls these functions.

matplotlib is imported inside the functions and only :class:`matplotlib.figure.Figure` is used
(the Agg canvas, no pyplot global state), so importing this module has no side effects and
figures can be drawn from any thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from pipeline.evaluate.normalize import l2_normalize

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure
    from PIL import Image

Columns = Mapping[str, np.ndarray]  # TSV column name -> (R,) float values

DPI = 100
MIN_TSNE_POINTS = 10  # below this a t-SNE map says nothing; the figure is skipped
MATCH_COLOUR = "#2ca02c"
MISMATCH_COLOUR = "#d62728"


def _figure(width: float, height: float, ncols: int = 1,
            nrows: int = 1) -> tuple[Figure, list[Any]]:
    """A fresh Agg-backed figure with an ``nrows x ncols`` grid of axes, listed row by row."""
    from matplotlib.figure import Figure  # lazy: no matplotlib work at import time

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as PNG (no software/date metadata, so bytes are reproducible)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI, metadata={"Software": None})
    return path


def _has(table: Columns, name: str) -> bool:
    """Whether ``table`` has column ``name`` with at least one finite value."""
    col = table.get(name)
    return col is not None and bool(np.isfinite(np.asarray(col, dtype=float)).any())


def _xcol(table: Columns, preferred: str = "step") -> tuple[np.ndarray, str]:
    """The x values (``preferred`` column, else row index) and their axis label."""
    if _has(table, preferred):
        return np.asarray(table[preferred], dtype=float), preferred
    n = len(next(iter(table.values()))) if table else 0
    return np.arange(n, dtype=float), "row"


def _integer_ticks(ax: Any) -> None:
    """Only whole numbers on the x axis (epochs)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _class_colours(num_classes: int) -> list[Any]:
    """Distinct colours: tab10 / tab20 for up to 20 classes, else evenly spaced turbo."""
    from matplotlib import colormaps

    if num_classes <= 10:
        return [colormaps["tab10"](i) for i in range(num_classes)]
    if num_classes <= 20:
        return [colormaps["tab20"](i) for i in range(num_classes)]
    cmap = colormaps["turbo"]
    return [cmap(i / max(num_classes - 1, 1)) for i in range(num_classes)]


def plot_pretrain_curves(table: Columns, path: Path) -> Path:
    """Pretraining loss (left) and the lr / key-encoder momentum ``m`` schedules (right).

    Args:
        table: columns of ``plots/pretrain.tsv``; uses ``step``, ``loss``, ``lr``, ``m``
            (missing ones are left out).
        path: the PNG to write.

    Returns:
        ``path``.
    """
    fig, (ax_loss, ax_lr) = _figure(10, 3.6, ncols=2)
    x, xlabel = _xcol(table)
    if _has(table, "loss"):
        ax_loss.plot(x, table["loss"], color="C0", label="InfoNCE loss")
        ax_loss.legend(loc="upper right")
    ax_loss.set(xlabel=xlabel, ylabel="loss", title="Contrastive loss")
    ax_loss.grid(alpha=0.3)
    handles = []
    if _has(table, "lr"):
        handles += ax_lr.plot(x, table["lr"], color="C1", label="lr (effective)")
    ax_lr.set(xlabel=xlabel, ylabel="learning rate", title="Schedules")
    ax_lr.grid(alpha=0.3)
    if _has(table, "m"):
        ax_m = ax_lr.twinx()
        handles += ax_m.plot(x, table["m"], color="C2", linestyle="--", label="momentum m")
        ax_m.set_ylabel("key-encoder momentum m")
    if handles:
        ax_lr.legend(handles=handles, loc="lower left")
    return _save(fig, path)


def plot_instance_accuracy(table: Columns, path: Path) -> Path:
    """Instance-discrimination accuracy (positive key ranked first / in top 5 of 1 + K logits).

    Args:
        table: columns of ``plots/pretrain.tsv``; uses ``step``, ``inst_top1``, ``inst_top5``
            (percent).
        path: the PNG to write.

    Returns:
        ``path``.
    """
    fig, (ax,) = _figure(6.5, 3.6)
    x, xlabel = _xcol(table)
    for name, label in (("inst_top1", "top-1"), ("inst_top5", "top-5")):
        if _has(table, name):
            ax.plot(x, table[name], label=label)
    ax.set(xlabel=xlabel, ylabel="accuracy (%)", title="Instance discrimination (pretext task)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def epoch_zero(table: Columns, column: str) -> float | None:
    """``column`` in the row of epoch 0 (the random init of a monitor TSV), or None."""
    if not (_has(table, "epoch") and _has(table, column)):
        return None
    epochs, values = (np.asarray(table[c], dtype=float) for c in ("epoch", column))
    hit = np.flatnonzero((epochs == 0) & np.isfinite(values))
    return float(values[hit[0]]) if len(hit) else None


def plot_knn_monitor(table: Columns, path: Path) -> Path:
    """kNN-monitor top-1 per epoch, its epoch-0 value (the random init) drawn dashed.

    Every point, the dashed line included, is measured on the same features and images: the
    monitor's epoch-0 row is the untrained encoder scored exactly as the later epochs are
    (:func:`epoch_zero`). Numbers measured on other features or images (the baselines stage)
    are not drawn here.

    Args:
        table: columns of ``plots/knn_monitor.tsv``; uses ``epoch`` and ``knn_top1`` (percent).
        path: the PNG to write.

    Returns:
        ``path``.
    """
    fig, (ax,) = _figure(6.5, 3.6)
    x, xlabel = _xcol(table, "epoch")
    if _has(table, "knn_top1"):
        ax.plot(x, table["knn_top1"], marker="o", color="C0", label="MoCo encoder")
    init = epoch_zero(table, "knn_top1")
    if init is not None:
        ax.axhline(init, color="C7", linestyle="--",
                   label=f"random init (epoch 0), same features and images: {init:.2f}")
    ax.set(xlabel=xlabel, ylabel="kNN top-1 (%)", title="kNN monitor during pretraining")
    _integer_ticks(ax)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_queue_age(table: Columns, path: Path, *, steady_state: float | None = None) -> Path:
    """Staleness of the negative keys: mean age of the queued keys, in training steps.

    Args:
        table: columns of ``plots/pretrain.tsv``; uses ``step`` and ``queue_mean_age``.
        path: the PNG to write.
        steady_state: the age expected once the FIFO queue is full (about ``K / (2 B)`` steps
            for ``K`` keys and ``B`` keys enqueued per step), drawn dotted when given.

    Returns:
        ``path``.
    """
    fig, (ax,) = _figure(6.5, 3.6)
    x, xlabel = _xcol(table)
    if _has(table, "queue_mean_age"):
        ax.plot(x, table["queue_mean_age"], color="C4", label="mean key age")
    if steady_state is not None:
        ax.axhline(steady_state, color="k", linestyle=":", label=f"K/(2B) = {steady_state:.1f}")
    ax.set(xlabel=xlabel, ylabel="age (steps)", title="Queue staleness")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_throughput(table: Columns, path: Path) -> Path:
    """Training throughput (images/s) and the fraction of step time spent waiting for data.

    Args:
        table: columns of ``plots/pretrain.tsv``; uses ``step``, ``images_per_s`` and
            ``data_wait_fraction`` (0-1).
        path: the PNG to write.

    Returns:
        ``path``.
    """
    fig, (ax_ips, ax_wait) = _figure(10, 3.6, ncols=2)
    x, xlabel = _xcol(table)
    if _has(table, "images_per_s"):
        ax_ips.plot(x, table["images_per_s"], color="C0")
        ax_ips.set_ylim(0, 1.1 * float(np.nanmax(table["images_per_s"])) or 1.0)
    ax_ips.set(xlabel=xlabel, ylabel="images / s", title="Throughput")
    ax_ips.grid(alpha=0.3)
    if _has(table, "data_wait_fraction"):
        ax_wait.plot(x, 100 * np.asarray(table["data_wait_fraction"], dtype=float), color="C1")
    ax_wait.set(xlabel=xlabel, ylabel="% of step time", title="Waiting for data")
    ax_wait.set_ylim(0, 100)
    ax_wait.grid(alpha=0.3)
    return _save(fig, path)


def plot_linear_curves(table: Columns, path: Path) -> Path:
    """Linear-probe training: loss with the lr schedule (left), accuracy (right).

    Args:
        table: columns of ``plots/linear.tsv``; uses ``epoch``, ``loss``, ``lr``,
            ``train_acc`` and, when present, ``val_acc`` (percent).
        path: the PNG to write.

    Returns:
        ``path``.
    """
    fig, (ax_loss, ax_acc) = _figure(10, 3.6, ncols=2)
    x, xlabel = _xcol(table, "epoch")
    handles = []
    if _has(table, "loss"):
        handles += ax_loss.plot(x, table["loss"], color="C0", label="cross-entropy")
    ax_loss.set(xlabel=xlabel, ylabel="loss", title="Linear probe loss")
    ax_loss.grid(alpha=0.3)
    if _has(table, "lr"):
        ax_lr = ax_loss.twinx()
        handles += ax_lr.plot(x, table["lr"], color="C1", linestyle="--", label="lr")
        ax_lr.set_ylabel("learning rate")
    if handles:
        ax_loss.legend(handles=handles, loc="upper right")
    for name, label in (("train_acc", "train"), ("val_acc", "validation")):
        if _has(table, name):
            ax_acc.plot(x, table[name], label=label)
    ax_acc.set(xlabel=xlabel, ylabel="accuracy (%)", title="Linear probe accuracy")
    _integer_ticks(ax_loss)
    _integer_ticks(ax_acc)
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(loc="lower right")
    return _save(fig, path)


def seeded_subsample(num_items: int, num_points: int, seed: int) -> np.ndarray:
    """Sorted indices of ``min(num_points, num_items)`` items drawn without replacement.

    Args:
        num_items: how many items there are.
        num_points: how many to keep.
        seed: seed of the numpy generator (same seed, same subset).

    Returns:
        (P,) int64 indices in increasing order.
    """
    n = max(0, min(num_points, num_items))
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_items, size=n, replace=False)).astype(np.int64)


def plot_tsne(
    features: Tensor,
    labels: Tensor,
    class_names: Sequence[str],
    path: Path,
    *,
    num_points: int,
    seed: int,
) -> Path | None:
    """2-D t-SNE of (a seeded subsample of) L2-normalised embeddings, coloured by class.

    t-SNE with PCA initialisation, ``learning_rate="auto"`` and perplexity
    ``min(30, P / 4)`` (sklearn's default 30, lowered so that small subsets stay valid).

    Args:
        features: (N, D) embeddings.
        labels: (N,) integer class labels, indices into ``class_names``.
        class_names: (C,) names for the legend.
        path: the PNG to write.
        num_points: at most this many points P are embedded.
        seed: seed of the subsample and of t-SNE.

    Returns:
        ``path``, or None (nothing written) when fewer than :data:`MIN_TSNE_POINTS` points.
    """
    from sklearn.manifold import TSNE

    idx = seeded_subsample(len(features), num_points, seed)
    if len(idx) < MIN_TSNE_POINTS:
        return None
    x = l2_normalize(features[torch.from_numpy(idx)].float()).numpy()  # (P, D)
    y = labels[torch.from_numpy(idx)].numpy()
    perplexity = min(30.0, len(idx) / 4)
    xy = TSNE(
        n_components=2, perplexity=perplexity, init="pca", learning_rate="auto", random_state=seed
    ).fit_transform(x)  # (P, 2)
    num_classes = max(len(class_names), int(y.max()) + 1)
    colours = _class_colours(num_classes)
    fig, (ax,) = _figure(7, 6)
    for c in range(num_classes):
        mask = y == c
        if mask.any():
            name = class_names[c] if c < len(class_names) else str(c)
            ax.scatter(xy[mask, 0], xy[mask, 1], s=6, color=colours[c], label=name)
    ax.set(title=f"t-SNE of {len(idx)} test embeddings", xticks=[], yticks=[])
    if num_classes <= 20:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), markerscale=2, frameon=False)
    return _save(fig, path)


def _show_image(ax: Any, image: Image.Image | None) -> None:
    """Draw a PIL image (grey images with a grey colour map) or a blank tile."""
    if image is None:
        ax.text(0.5, 0.5, "missing", ha="center", va="center", fontsize=7)
    else:
        arr = np.asarray(image)
        if arr.ndim == 2:
            ax.imshow(arr, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        else:
            ax.imshow(arr, interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_retrieval(
    query_images: Sequence[Image.Image | None],
    query_labels: Sequence[int],
    neighbour_images: Sequence[Sequence[Image.Image | None]],
    neighbour_labels: Sequence[Sequence[int]],
    neighbour_similarities: Sequence[Sequence[float]],
    class_names: Sequence[str],
    path: Path,
) -> Path:
    """Grid: one row per test query, then its nearest training images (green = same class).

    Args:
        query_images: (Q,) images (None draws a "missing" tile).
        query_labels: (Q,) class indices of the queries.
        neighbour_images: (Q, k) images of the neighbours, most similar first.
        neighbour_labels: (Q, k) class indices of the neighbours.
        neighbour_similarities: (Q, k) cosine similarities, shown above each neighbour.
        class_names: (C,) names.
        path: the PNG to write.

    Returns:
        ``path``.
    """

    def name(c: int) -> str:
        return class_names[c] if 0 <= c < len(class_names) else str(c)

    rows = len(query_images)
    cols = 1 + max((len(r) for r in neighbour_images), default=0)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.3 * cols, 1.45 * rows + 0.4), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    fig.suptitle("Nearest training images (cosine) of test queries; green = same class")
    for r in range(rows):
        ax = axes[r][0]
        _show_image(ax, query_images[r])
        ax.set_title(f"query\n{name(query_labels[r])}", fontsize=7, fontweight="bold")
        for spine in ax.spines.values():
            spine.set(edgecolor="black", linewidth=2)
        for j in range(cols - 1):
            ax = axes[r][j + 1]
            if j >= len(neighbour_images[r]):
                ax.axis("off")
                continue
            _show_image(ax, neighbour_images[r][j])
            same = neighbour_labels[r][j] == query_labels[r]
            colour = MATCH_COLOUR if same else MISMATCH_COLOUR
            ax.set_title(
                f"{name(neighbour_labels[r][j])}\n{neighbour_similarities[r][j]:.2f}",
                fontsize=7,
                color=colour,
            )
            for spine in ax.spines.values():
                spine.set(edgecolor=colour, linewidth=3)
    return _save(fig, path)


def plot_confusion(
    matrix: np.ndarray, class_names: Sequence[str], path: Path, *, title: str
) -> Path:
    """Confusion-matrix heatmap, colour = row-normalised percent, counts written for C <= 20.

    Args:
        matrix: (C, C) counts, rows = true class, columns = predicted class.
        class_names: (C,) names for both axes (tick labels omitted for C > 30).
        path: the PNG to write.
        title: the figure title.

    Returns:
        ``path``.
    """
    counts = np.asarray(matrix, dtype=np.int64)
    c = counts.shape[0]
    row_pct = 100 * counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)  # (C, C)
    side = min(max(4.0, 0.55 * c + 2.5), 14.0)
    fig, (ax,) = _figure(side + 1, side)
    im = ax.imshow(row_pct, cmap="Blues", vmin=0, vmax=100)
    fig.colorbar(im, ax=ax, shrink=0.8, label="% of true class")
    if c <= 30:
        ticks = np.arange(c)
        ax.set_xticks(ticks, list(class_names), rotation=60, ha="right", fontsize=8)
        ax.set_yticks(ticks, list(class_names), fontsize=8)
    if c <= 20:
        for i in range(c):
            for j in range(c):
                ax.text(
                    j,
                    i,
                    str(counts[i, j]),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if row_pct[i, j] > 50 else "black",
                )
    ax.set(xlabel="predicted", ylabel="true", title=title)
    return _save(fig, path)


def plot_per_class_accuracy(
    class_names: Sequence[str], accuracies: Mapping[str, Sequence[float]], path: Path
) -> Path:
    """Grouped bars of per-class top-1 accuracy, one bar per classifier (kNN, linear, ...).

    Args:
        class_names: (C,) names on the x axis.
        accuracies: classifier name -> (C,) accuracy in percent.
        path: the PNG to write.

    Returns:
        ``path``.
    """
    c = len(class_names)
    fig, (ax,) = _figure(min(max(6.0, 0.6 * c + 2), 20.0), 4)
    x = np.arange(c)
    width = 0.8 / max(len(accuracies), 1)
    for i, (label, acc) in enumerate(accuracies.items()):
        ax.bar(x + (i - (len(accuracies) - 1) / 2) * width, acc, width=width, label=label)
    ax.set_xticks(
        x,
        list(class_names),
        rotation=45 if c > 5 else 0,
        ha="right" if c > 5 else "center",
        fontsize=8,
    )
    ax.set(ylabel="top-1 accuracy (%)", ylim=(0, 100), title="Per-class accuracy")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return _save(fig, path)
