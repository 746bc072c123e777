"""Build the report's sections from :class:`~pipeline.report.inputs.RunOutputs`.

A report is a :class:`~pipeline.report.document.Document` of sections
(:mod:`pipeline.report.document`); the results table is :mod:`pipeline.report.results`', the
quality sections (no labels, few labels) :mod:`pipeline.report.quality`'s, the near-duplicates
and outliers :mod:`pipeline.report.insights`', the cost, runs, outputs and provenance
:mod:`pipeline.report.provenance`'s. A number that is missing from the inputs is shown as
:data:`~pipeline.report.document.NOT_AVAILABLE`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import Params
from pipeline.evaluate.knn import DEFAULT_K, DEFAULT_T, knn_neighbours
from pipeline.report import figures as fg
from pipeline.report.document import (
    NOT_AVAILABLE,
    Block,
    Document,
    FigureRef,
    Paragraph,
    Section,
    Table,
    fmt,
)
from pipeline.report.inputs import Embeddings, Metrics, RunOutputs, load_shard_images, metric
from pipeline.report.insights import insights_section
from pipeline.report.provenance import (
    cost_section,
    lock_section,
    provenance_section,
    report_time,
    runs_section,
)
from pipeline.report.quality import label_efficiency_section, labelfree_section
from pipeline.report.results import pct, results_section
from pipeline.report.selection import selection_section


def build_document(
    params: Params, outputs: RunOutputs, fig_dir: Path, git_commit: str | None = None,
    *, git_dirty: str | None = None, written: str | None = None,
    here: Mapping[str, str] | None = None,
) -> Document:
    """Every section of the report; the figures are drawn into ``fig_dir`` on the way.

    Args:
        params: the validated run params (settings, t-SNE / retrieval sizes, seed, published
            reference lookup).
        outputs: the pipeline's outputs (:func:`pipeline.report.inputs.read_outputs`).
        fig_dir: an existing directory; each :class:`FigureRef` names a PNG written there.
        git_commit: shown in the subtitle and the provenance when given.
        git_dirty: ``"true"`` / ``"false"``: whether tracked files differ from ``git_commit``.
        written: when the report is written (default
            :func:`pipeline.report.provenance.report_time`).
        here: this process's machine and libraries (default
            :func:`pipeline.train.runtime.describe_machine`).

    Returns:
        The :class:`Document`.
    """
    from pipeline.train.runtime import describe_machine

    m = outputs.metrics
    pretrain_run = outputs.runs.get("pretrain")
    labelled = outputs.no_labels is None
    sections = [
        settings_section(params, pretrain_run.ran if pretrain_run is not None else None),
        results_section(params, m) if labelled else no_labels_section(outputs.no_labels),
        pretrain_section(params, outputs, fig_dir),
        labelfree_section(outputs, fig_dir),
        *([evaluation_section(outputs, fig_dir), label_efficiency_section(outputs, fig_dir)]
          if labelled else []),
        insights_section(outputs, params.report.insight_images, fig_dir),
        selection_section(outputs.root, str(params.selection.method),
                          params.report.insight_images, fig_dir),
        *([embedding_section(params, outputs, fig_dir)] if labelled else []),
        cost_section(m),
        runs_section(outputs),
        lock_section(outputs),
        provenance_section(outputs, written=written or report_time(),
                           here=describe_machine() if here is None else here,
                           git_commit=git_commit, git_dirty=git_dirty),
    ]
    title = f"MoCo report: {params.data.source} / {params.model.backbone}"
    subtitle = (
        f"MoCo {'v2' if params.model.head == 'mlp' else 'v1'}-style pretraining, "
        f"{params.pretrain.epochs} epochs; git commit {git_commit or NOT_AVAILABLE}."
    )
    return Document(title, subtitle, sections)


def no_labels_section(why: str) -> Section:
    """In place of the results: why nothing was evaluated with labels, and what follows."""
    return Section("Results", [Paragraph(
        f"Evaluation with labels skipped: {why}. kNN, the linear probe, the baselines and the "
        "label-efficiency curve need labelled train and test images (a labelled data.source, "
        "docs/data.md). What needs no labels follows: the pretraining, the label-free numbers, "
        "the near-duplicates and the outliers.")])


# --------------------------------------------------------------------------- formatting


def settings_section(p: Params, ran: Mapping[str, Any] | None = None) -> Section:
    """The params that define the run, one row per concern.

    Args:
        p: the params.
        ran: how pretraining ran (``runs/pretrain.json``'s ``ran``): the precision that
            ``pretrain.precision: auto`` resolved to is shown beside it.
    """
    precision = str(p.pretrain.precision)
    if ran and ran.get("precision") and ran["precision"] != precision:
        precision += f" (ran as {ran['precision']})"
    lr_eff = p.pretrain.lr * p.pretrain.batch_size / 256
    lin_eff = p.linear.lr * p.linear.batch_size / 256
    dataset = (
        f"{p.data.source}"
        + (f" ({p.data.root})" if p.data.root else "")
        + (f", resized to {p.data.image_size} px" if p.data.image_size else ", native size")
    )
    pretrain_from = [text for text, used in (
        ("the labelled train images", p.data.pretrain_labelled and p.data.source != "none"),
        (f"the unlabelled tree {p.data.unlabelled_root}", bool(p.data.unlabelled_root))) if used]
    rows = [
        ["dataset", dataset],
        *([["pretraining images", ", ".join(pretrain_from)]] if len(pretrain_from) > 1
          or pretrain_from[:1] != ["the labelled train images"] else []),
        [
            "backbone",
            f"{p.model.backbone}, width {p.model.width}, small stem "
            f"{p.model.small_stem} (stride {p.model.stem_stride}); "
            f"{p.model.head} head -> dim {p.model.dim}",
        ],
        [
            "MoCo",
            f"K={p.moco.K}, m={p.moco.m:g} ({p.moco.m_schedule}), T={p.moco.T:g}, "
            f"BN {p.moco.bn}, symmetric {p.moco.symmetric}",
        ],
        [
            "pretraining",
            f"{p.pretrain.epochs} epochs, batch {p.pretrain.batch_size}, lr "
            f"{p.pretrain.lr:g} per 256 (effective {lr_eff:g}), "
            f"{p.pretrain.lr_schedule}, wd {p.pretrain.weight_decay:g}, "
            f"precision {precision}",
        ],
        ["augmentation", f"preset {p.augment.preset}, crop scale >= {p.augment.crop_min_scale:g}"],
        ["features", "after the projection head" if p.embed.use_head else
         "backbone (pre-head), " + _pooling(p.embed.layer, p.embed.pool_grid)],
        ["kNN", f"k={p.knn.k}, T={p.knn.T:g}" if p.knn.select == "fixed"
         else "k and T chosen on 10 % of train (grid k 1-200, T 0.02-1)"],
        [
            "linear probe",
            f"mode {p.linear.mode}, {p.linear.epochs} epochs, batch "
            f"{p.linear.batch_size}, lr {p.linear.lr:g} per 256 (effective "
            f"{lin_eff:g}), {p.linear.lr_schedule} {list(p.linear.lr_milestones)}",
        ],
        ["seed", str(p.seed)],
    ]
    return Section("Settings", [Table(["setting", "value"], rows)])


def _pooling(layer: int, grid: int) -> str:
    """The features' pooling in words (``embed.layer``, ``embed.pool_grid``)."""
    stage = "last stage" if layer == 4 else f"layer{layer}"
    if grid == 1:
        return "global average pool" + ("" if layer == 4 else f" of {stage}")
    return f"{stage} average-pooled to {grid} x {grid} cells, flattened"


# --------------------------------------------------------------------------- pretraining


def _monitor_ends(monitor: fg.Columns | None) -> tuple[float | None, float | None]:
    """kNN-monitor top-1 at the random init (epoch 0) and at the last monitor point."""
    if monitor is None or not fg._has(monitor, "knn_top1"):
        return None, None
    values = np.asarray(monitor["knn_top1"], dtype=float)
    finite = values[np.isfinite(values)]
    return fg.epoch_zero(monitor, "knn_top1"), float(finite[-1])


def _pretrain_table(pre: Metrics | None, monitor: fg.Columns | None) -> Table:
    steps = fmt(metric(pre, "steps"), ".0f")
    epochs = fmt(metric(pre, "epochs"), ".0f")
    init, end = _monitor_ends(monitor)
    return Table(
        ["metric", "value"],
        [
            ["final InfoNCE loss", fmt(metric(pre, "loss"), ".4f")],
            ["instance discrimination top-1 / top-5 (%)",
             f"{pct(pre, 'inst_top1')} / {pct(pre, 'inst_top5')}"],
            ["steps / epochs", f"{steps} / {epochs}"],
            ["kNN monitor top-1 at init -> end (%)", f"{fmt(init)} -> {fmt(end)}"],
        ],
    )


def _training_curves(p: Params, table: fg.Columns | None, fig_dir: Path) -> list[Block]:
    if table is None:
        return [Paragraph(f"Training curves: {NOT_AVAILABLE} (plots/pretrain.tsv).")]
    fg.plot_pretrain_curves(table, fig_dir / "pretrain_curves.png")
    fg.plot_instance_accuracy(table, fig_dir / "instance_accuracy.png")
    steady = None if p.moco.symmetric else p.moco.K / (2 * p.pretrain.batch_size)
    fg.plot_queue_age(table, fig_dir / "queue_age.png", steady_state=steady)
    fg.plot_throughput(table, fig_dir / "throughput.png")
    return [
        FigureRef("pretrain_curves.png", "InfoNCE loss; learning rate and key-encoder momentum m."),
        FigureRef(
            "instance_accuracy.png",
            "Instance-discrimination accuracy: the positive key ranked first (top-1) or in the "
            "top 5 of 1 + K logits.",
        ),
        FigureRef(
            "queue_age.png",
            "Mean age (training steps) of the negative keys in the queue; the key encoder "
            "drifts during that time.",
        ),
        FigureRef(
            "throughput.png",
            "Images per second and the share of step time spent waiting for the data loader.",
        ),
    ]


def _monitor_setup(p: Params, outputs: RunOutputs) -> str:
    """The monitor's kNN and images in words: k (capped at the bank), T, the first N / M images."""
    sizes = {}
    for split, cap in (("train", p.pretrain.knn_monitor_train_images),
                       ("test", p.pretrain.knn_monitor_test_images)):
        size = outputs.split_sizes.get(split)
        n = cap if size is None else min(cap, size)
        sizes[split] = (f"the first {n:,} " + ("labelled train" if split == "train" else "test")
                        + " images" + (" (at most)" if size is None else ""),
                        None if size is None else n)
    bank = sizes["train"][1]
    k = (f"k={DEFAULT_K}" if bank is not None and bank >= DEFAULT_K else
         f"k={DEFAULT_K} capped at the bank" if bank is None else
         f"k={bank} ({DEFAULT_K} capped at the bank)")
    return (f"{k}, T={DEFAULT_T:g}, global average pool of the last stage; bank = "
            f"{sizes['train'][0]}, queries = {sizes['test'][0]}")


def _knn_monitor(p: Params, outputs: RunOutputs, fig_dir: Path) -> Block:
    monitor = outputs.plots["knn_monitor"]
    if monitor is None:
        return Paragraph(f"kNN monitor: {NOT_AVAILABLE} (plots/knn_monitor.tsv).")
    fg.plot_knn_monitor(monitor, fig_dir / "knn_monitor.png")
    init, end = _monitor_ends(monitor)
    versus = ("No epoch-0 row (the random init): nothing on the same features to compare."
              if init is None or end is None else
              f"Dashed: epoch 0, the random init, measured the same way; the last point is "
              f"{end - init:+.2f} points from it.")
    return FigureRef(
        "knn_monitor.png",
        f"kNN top-1 of the monitor per epoch ({_monitor_setup(p, outputs)}; "
        f"pretrain.knn_monitor_*). {versus} The baselines stage's numbers are on other features "
        "and all images: see Results.",
    )


def pretrain_section(p: Params, outputs: RunOutputs, fig_dir: Path) -> Section:
    """Final pretraining metrics, the training curves and the kNN monitor."""
    m = outputs.metrics
    return Section(
        "Pretraining",
        [
            _pretrain_table(m["pretrain"], outputs.plots["knn_monitor"]),
            *_training_curves(p, outputs.plots["pretrain"], fig_dir),
            _knn_monitor(p, outputs, fig_dir),
        ],
    )


# --------------------------------------------------------------------------- evaluation


def evaluation_section(outputs: RunOutputs, fig_dir: Path) -> Section:
    """Linear-probe curves, both confusion matrices and the per-class accuracy bars."""
    sec = Section("Evaluation")
    lin_table = outputs.plots["linear"]
    if lin_table is None:
        sec.blocks.append(Paragraph(f"Linear-probe curves: {NOT_AVAILABLE} (plots/linear.tsv)."))
    else:
        fg.plot_linear_curves(lin_table, fig_dir / "linear_curves.png")
        sec.blocks.append(FigureRef(
            "linear_curves.png",
            "Linear probe on frozen features: loss, lr schedule and accuracy per epoch.",
        ))
    per_class: dict[str, list[float]] = {}
    names: list[str] | None = None
    for label, stem in (("kNN", "knn"), ("linear", "linear")):
        det = outputs.details[stem]
        if det is None:
            sec.blocks.append(
                Paragraph(f"{label} confusion matrix: {NOT_AVAILABLE} (eval/{stem}_details.json).")
            )
            continue
        fg.plot_confusion(det.confusion, det.class_names, fig_dir / f"confusion_{stem}.png",
                          title=f"{label} confusion matrix (test set)")
        sec.blocks.append(FigureRef(
            f"confusion_{stem}.png",
            f"{label}: rows = true class, colour = % of the true class, numbers = counts.",
        ))
        if det.per_class_accuracy is not None and names in (None, det.class_names):
            names = det.class_names
            per_class[label] = det.per_class_accuracy
    if names is not None:
        fg.plot_per_class_accuracy(names, per_class, fig_dir / "per_class_accuracy.png")
        sec.blocks.append(FigureRef("per_class_accuracy.png", "Per-class top-1 accuracy."))
    return sec


# --------------------------------------------------------------------------- embeddings


def _class_names(outputs: RunOutputs, num_classes: int) -> list[str]:
    """Class names from the test-shard manifest, else the details files, else the indices."""
    candidates = [outputs.test_class_names]
    candidates += [d.class_names if d else None for d in outputs.details.values()]
    for names in candidates:
        if names is not None and len(names) >= num_classes:
            return names
    return [str(i) for i in range(num_classes)]


def _tsne_block(p: Params, test: Embeddings | None, names: list[str], fig_dir: Path) -> Block:
    if test is None:
        return Paragraph(f"t-SNE: {NOT_AVAILABLE} (features/test.pt).")
    n = p.report.tsne_points
    drawn = fg.plot_tsne(test.features, test.labels, names, fig_dir / "tsne.png",
                         num_points=n, seed=p.seed)
    if drawn is None:
        return Paragraph(
            f"t-SNE: skipped (report.tsne_points = {n}, {len(test.labels)} test embeddings; "
            f"at least {fg.MIN_TSNE_POINTS} needed)."
        )
    return FigureRef(
        "tsne.png",
        f"t-SNE of up to {n} test embeddings (L2-normalised), coloured by class.",
    )


def _retrieval_block(
    p: Params, outputs: RunOutputs, names: list[str], fig_dir: Path
) -> Block:
    test, train = outputs.features["test"], outputs.features["train"]
    if p.report.retrieval_queries == 0:
        return Paragraph("Retrieval: skipped (report.retrieval_queries = 0).")
    if test is None or train is None:
        return Paragraph(f"Retrieval: {NOT_AVAILABLE} (features/test.pt, features/train.pt).")
    if outputs.shards_are_url:
        return Paragraph(f"Retrieval: {NOT_AVAILABLE} (it reads local shards; data.shards_dir "
                         f"is the URL {p.data.shards_dir}).")
    shards = outputs.shards_dir
    if not (shards / "test").is_dir() or not (shards / "train").is_dir():
        return Paragraph(f"Retrieval: {NOT_AVAILABLE} (shards in {p.data.shards_dir}).")
    q_idx = fg.seeded_subsample(len(test.labels), p.report.retrieval_queries, p.seed)
    nn_sim, nn_idx = knn_neighbours(
        train.features, test.features[q_idx],
        k=min(p.report.retrieval_neighbours, len(train.features)),
    )  # (Q, k) each
    q_keys = [test.keys[i] for i in q_idx]
    n_keys = [[train.keys[j] for j in row] for row in nn_idx.tolist()]
    q_img = load_shard_images(shards / "test", q_keys)
    n_img = load_shard_images(shards / "train", [k for row in n_keys for k in row])
    if not q_img and not n_img:
        return Paragraph(f"Retrieval: {NOT_AVAILABLE} (no images of the keys in the shards).")
    fg.plot_retrieval(
        [q_img.get(k) for k in q_keys],
        test.labels[q_idx].tolist(),
        [[n_img.get(k) for k in row] for row in n_keys],
        train.labels[nn_idx].tolist(),
        nn_sim.tolist(),
        names,
        fig_dir / "retrieval.png",
    )
    return FigureRef(
        "retrieval.png",
        f"{len(q_keys)} random test images (left) and their {nn_idx.shape[1]} nearest training "
        "images by cosine similarity of the frozen features; green = same class, red = "
        "different class.",
    )


def embedding_section(p: Params, outputs: RunOutputs, fig_dir: Path) -> Section:
    """The t-SNE map of the test embeddings and the nearest-neighbour retrieval figure."""
    present = [f for f in (outputs.features["test"], outputs.features["train"]) if f is not None]
    num_classes = max((int(f.labels.max()) + 1 for f in present if len(f.labels)), default=0)
    names = _class_names(outputs, num_classes)
    return Section(
        "Embeddings",
        [
            _tsne_block(p, outputs.features["test"], names, fig_dir),
            _retrieval_block(p, outputs, names, fig_dir),
        ],
    )


# --------------------------------------------------------------------------- cost, provenance


__all__ = [
    "NOT_AVAILABLE",
    "Block",
    "Document",
    "FigureRef",
    "Paragraph",
    "Section",
    "Table",
    "build_document",
]
