"""Build the report's sections from :class:`~pipeline.report.inputs.RunOutputs`.

A report is a :class:`~pipeline.report.document.Document` of sections
(:mod:`pipeline.report.document`); the quality sections (no labels, few labels) are
:mod:`pipeline.report.quality`'s, the near-duplicates and outliers
:mod:`pipeline.report.insights`'. A number that is missing from the inputs is shown as
:data:`~pipeline.report.document.NOT_AVAILABLE`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

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
from pipeline.report.provenance import cost_section, lock_section, runs_section
from pipeline.report.quality import label_efficiency_section, labelfree_section
from pipeline.report.references import PROTOCOL_NAMES, published_reference, reference_note

KNN_PROTOCOL = f"k={DEFAULT_K}, T={DEFAULT_T:g}"  # the InstDisc / MoCo CIFAR demo kNN


def build_document(
    params: Params, outputs: RunOutputs, fig_dir: Path, git_commit: str | None = None
) -> Document:
    """Every section of the report; the figures are drawn into ``fig_dir`` on the way.

    Args:
        params: the validated run params (settings, t-SNE / retrieval sizes, seed, published
            reference lookup).
        outputs: the pipeline's outputs (:func:`pipeline.report.inputs.read_outputs`).
        fig_dir: an existing directory; each :class:`FigureRef` names a PNG written there.
        git_commit: shown in the subtitle when given.

    Returns:
        The :class:`Document`.
    """
    m = outputs.metrics
    sections = [
        settings_section(params),
        results_section(params, m),
        pretrain_section(params, outputs, fig_dir),
        labelfree_section(outputs, fig_dir),
        evaluation_section(outputs, fig_dir),
        label_efficiency_section(outputs, fig_dir),
        insights_section(outputs, params.report.insight_images, fig_dir),
        embedding_section(params, outputs, fig_dir),
        cost_section(m),
        runs_section(outputs),
        lock_section(outputs),
    ]
    title = f"MoCo report: {params.data.source} / {params.model.backbone}"
    subtitle = (
        f"MoCo {'v2' if params.model.head == 'mlp' else 'v1'}-style pretraining, "
        f"{params.pretrain.epochs} epochs; git commit {git_commit or NOT_AVAILABLE}."
    )
    return Document(title, subtitle, sections)


# --------------------------------------------------------------------------- formatting


def _pct(m: Metrics | None, key: str) -> str:
    """A percentage with two decimals (the unit is in the column header)."""
    return fmt(metric(m, key))


def settings_section(p: Params) -> Section:
    """The params that define the run, one row per concern."""
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
            f"precision {p.pretrain.precision}",
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


def _results_rows(p: Params, m: Mapping[str, Metrics | None]) -> list[list[str]]:
    knn, lin, base = m["knn"], m["linear"], m["baselines"]
    k = int(metric(knn, "k") or p.knn.k)
    temp = metric(knn, "T") or p.knn.T
    augment = metric(lin, "mode_augment")  # what the probe actually ran, else the params
    lin_mode = p.linear.mode if augment is None else ("augment" if augment else "features")
    lin_epochs = int(metric(lin, "epochs") or p.linear.epochs)
    chosen = " (chosen on a validation split of train)" if metric(knn, "select_val") else ""
    rows = [
        ["MoCo encoder + kNN", f"k={k}, T={temp:g}{chosen}", _pct(knn, "top1"),
         _pct(knn, "top5")],
        [
            "MoCo encoder + linear probe",
            f"{lin_mode}, {lin_epochs} epochs",
            _pct(lin, "top1"),
            _pct(lin, "top5"),
        ],
        ["raw pixels (baseline)", f"kNN, {KNN_PROTOCOL}", _pct(base, "raw_pixels_top1"),
         _pct(base, "raw_pixels_top5")],
    ]
    if metric(knn, "protocol_top1") is not None:  # the published protocol, beside ours
        rows.insert(1, ["MoCo encoder + kNN, MoCo protocol",
                        f"global pool, {KNN_PROTOCOL}", _pct(knn, "protocol_top1"),
                        _pct(knn, "protocol_top5")])
    if metric(lin, "protocol_top1") is not None:
        rows.insert(len(rows) - 1, ["MoCo encoder + linear probe, MoCo protocol",
                                    "global pool, raw features, lr 30, 100 epochs",
                                    _pct(lin, "protocol_top1"), _pct(lin, "protocol_top5")])
    tk, tt = metric(base, "raw_pixels_knn_tuned_k"), metric(base, "raw_pixels_knn_tuned_T")
    if tk is not None and tt is not None:
        rows.append(["raw pixels (baseline)",
                     f"kNN, k={int(tk)}, T={tt:g} (chosen on a validation split of train)",
                     _pct(base, "raw_pixels_knn_tuned_top1"),
                     _pct(base, "raw_pixels_knn_tuned_top5")])
    if metric(base, "raw_pixels_linear_top1") is not None:
        rows.append(["raw pixels (baseline)", f"linear probe, features, {lin_epochs} epochs",
                     _pct(base, "raw_pixels_linear_top1"), _pct(base, "raw_pixels_linear_top5")])
    rows.append(["random-init encoder (baseline)", f"kNN, {KNN_PROTOCOL}",
                 _pct(base, "random_encoder_top1"), _pct(base, "random_encoder_top5")])
    ref = published_reference(p)
    if ref is not None:
        rows.append([f"published ({ref.epochs} epochs)", PROTOCOL_NAMES[ref.protocol],
                     f"{ref.top1:.2f}", NOT_AVAILABLE])
    return rows


def best_pixel_baselines(base: Metrics | None) -> dict[str, float | None]:
    """The best raw-pixel top-1 (%) per protocol: ``{"kNN": ..., "linear": ...}``.

    kNN: the better of the reference protocol (:data:`KNN_PROTOCOL`) and the validation-tuned kNN;
    linear: the raw-pixel linear probe. ``None`` where the baselines stage did not report it.
    """
    knn = [v for v in (metric(base, "raw_pixels_top1"), metric(base, "raw_pixels_knn_tuned_top1"))
           if v is not None]
    return {"kNN": max(knn) if knn else None, "linear": metric(base, "raw_pixels_linear_top1")}


# top-1 points between two seeds of one recipe on Fashion-MNIST: 0.3-0.5
# (results/sweep-2026-12-02-width-multicrop.md); a smaller gap of one run decides nothing
SEED_NOISE_POINTS = 0.3


def headline(m: Mapping[str, Metrics | None]) -> str | None:
    """One sentence: MoCo against the best raw-pixel baseline on each protocol, or None.

    A gap under :data:`SEED_NOISE_POINTS` either way reads "is level with ... (within seed
    noise)": one run cannot tell it from the seed's effect.
    """
    best = best_pixel_baselines(m["baselines"])
    parts = []
    for name, res in (("kNN", m["knn"]), ("linear", m["linear"])):
        ours, px = metric(res, "top1"), best[name]
        if ours is not None and px is not None:
            gap = round(ours - px, 2)  # as printed: 78.5 vs 78.8 is 0.30, not 0.2999...
            if abs(gap) < SEED_NOISE_POINTS:
                parts.append(f"{name}: MoCo {ours:.2f} % is level with the best raw-pixel "
                             f"{name} {px:.2f} % ({gap:+.2f} points, within seed noise "
                             f"of {SEED_NOISE_POINTS:g})")
                continue
            verdict = "beats" if ours > px else "does not beat"
            parts.append(f"{name}: MoCo {ours:.2f} % {verdict} the best raw-pixel {name} "
                         f"{px:.2f} % ({ours - px:+.2f} points)")
    return ("Headline — " + "; ".join(parts) + ".") if parts else None


def _results_notes(p: Params, m: Mapping[str, Metrics | None]) -> list[Paragraph]:
    knn, lin, base = m["knn"], m["linear"], m["baselines"]
    notes = []
    if metric(knn, "val_top1") is not None:
        notes.append(Paragraph(f"kNN validation top-1 (held out of the train set): "
                               f"{_pct(knn, 'val_top1')} %."))
    if metric(lin, "val_top1") is not None:
        notes.append(Paragraph(f"Linear probe validation top-1 (held out of the train set): "
                               f"{_pct(lin, 'val_top1')} %."))
    gains = []
    best = best_pixel_baselines(base)
    for name, res in (("kNN", knn), ("linear", lin)):
        top1 = metric(res, "top1")
        against = [(f"the best raw-pixel {name}", best[name])]
        if name == "kNN":  # the random encoder is only kNN-scored: same protocol only
            against.append(("the random encoder's kNN", metric(base, "random_encoder_top1")))
        for bname, b in against:
            if top1 is not None and b is not None:
                gains.append(f"{name} {top1 - b:+.2f} points vs {bname}")
    if gains:
        notes.append(Paragraph("Top-1 gains: " + "; ".join(gains) + "."))
    notes.append(Paragraph(reference_note(p)))
    ref = published_reference(p)
    ours = None if ref is None else metric(knn if ref.protocol == "knn" else lin, "top1")
    if ref is not None and ours is not None:
        notes.append(Paragraph(f"This run's {PROTOCOL_NAMES[ref.protocol]} top-1 is "
                               f"{ours - ref.top1:+.2f} points from the published number."))
    return notes


def results_section(p: Params, m: Mapping[str, Metrics | None]) -> Section:
    """The results table (MoCo kNN / linear, baselines, published number) and the gains."""
    table = Table(["method", "protocol", "top-1 (%)", "top-5 (%)"], _results_rows(p, m))
    head = headline(m)
    return Section("Results", [*([Paragraph(head)] if head else []), table,
                               *_results_notes(p, m)])


# --------------------------------------------------------------------------- pretraining


def _pretrain_table(pre: Metrics | None) -> Table:
    steps = fmt(metric(pre, "steps"), ".0f")
    epochs = fmt(metric(pre, "epochs"), ".0f")
    return Table(
        ["metric", "value"],
        [
            ["final InfoNCE loss", fmt(metric(pre, "loss"), ".4f")],
            ["instance discrimination top-1 / top-5 (%)",
             f"{_pct(pre, 'inst_top1')} / {_pct(pre, 'inst_top5')}"],
            ["steps / epochs", f"{steps} / {epochs}"],
            ["kNN monitor top-1 at init -> end (%)",
             f"{_pct(pre, 'knn_top1_init')} -> {_pct(pre, 'knn_top1')}"],
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


def _knn_monitor(monitor: fg.Columns | None, base: Metrics | None, fig_dir: Path) -> Block:
    if monitor is None:
        return Paragraph(f"kNN monitor: {NOT_AVAILABLE} (plots/knn_monitor.tsv).")
    fg.plot_knn_monitor(
        monitor,
        fig_dir / "knn_monitor.png",
        random_encoder_top1=metric(base, "random_encoder_top1"),
        raw_pixels_top1=metric(base, "raw_pixels_top1"),
    )
    return FigureRef(
        "knn_monitor.png",
        "kNN top-1 of the monitor (on pretrain.knn_monitor_* images) per epoch, epoch 0 = "
        "random init; dashed: kNN top-1 of the baselines stage (whole train/test sets; the "
        "random encoder pooled as embed.layer and embed.pool_grid, while the monitor pools the "
        "last stage globally).",
    )


def pretrain_section(p: Params, outputs: RunOutputs, fig_dir: Path) -> Section:
    """Final pretraining metrics, the training curves and the kNN monitor."""
    m = outputs.metrics
    return Section(
        "Pretraining",
        [
            _pretrain_table(m["pretrain"]),
            *_training_curves(p, outputs.plots["pretrain"], fig_dir),
            _knn_monitor(outputs.plots["knn_monitor"], m["baselines"], fig_dir),
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
