"""Assemble the run report: read every stage's outputs, draw the figures, write HTML + Markdown.

:func:`build_report` reads the pipeline outputs below ``root`` (any of which may be missing:
the report then says "not available"), draws the PNGs of :mod:`pipeline.report.figures` and
writes::

    out_dir/report.html    self-contained: figures embedded as base64 data URIs
    out_dir/report.md      the same tables, figures linked as figures/<name>.png
    out_dir/figures/*.png

The whole directory is rendered next to ``out_dir`` and moved into place at the end, so a failed
or interrupted report never leaves a half-written one. The body holds no wall-clock date, so the
same inputs give the same bytes.

:func:`collect_final_metrics` gives the union of all final metrics (for MLflow) and
:func:`check_html` verifies that every image of an HTML file can be displayed.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import html
import io
import json
import logging
import math
import os
import shutil
import tarfile
import tempfile
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

import numpy as np

from pipeline.config import Params
from pipeline.data.remote import is_url, shards_location
from pipeline.data.shards import ShardError, read_manifest
from pipeline.report import figures as fg

log = logging.getLogger(__name__)

NOT_AVAILABLE = "not available"
TRACKED_STAGES = ("build_shards", "pretrain", "embed", "baselines", "knn", "linear")
METRICS_FILES = {  # metric-name prefix -> metrics file (relative to the repo root)
    "pretrain": "metrics/pretrain.json",
    "embed": "metrics/embed.json",
    "baselines": "metrics/baselines.json",
    "knn": "metrics/knn.json",
    "linear": "metrics/linear.json",
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- published numbers


@dataclass(frozen=True)
class Reference:
    """A published top-1 accuracy to compare the run against.

    Attributes:
        protocol: ``"knn"`` or ``"linear"``: which of this run's results it is comparable to.
        top1: top-1 accuracy in percent.
        epochs: pretraining epochs behind the number.
        citation: where the number comes from.
    """

    protocol: str
    top1: float
    epochs: int
    citation: str


_CIFAR10_R18 = Reference(
    "knn",
    82.6,
    200,
    "MoCo CIFAR-10 demo (facebookresearch/moco colab notebook): ResNet-18, K=4096, m=0.99, "
    "T=0.1, kNN k=200 T=0.1",
)
_IMAGENET_R50_V2 = Reference(
    "linear",
    67.5,
    200,
    "MoCo v2 (Chen et al. 2020, facebookresearch/moco): ImageNet-1k, ResNet-50, linear probe",
)


def published_reference(params: Params) -> Reference | None:
    """The published number for this run's preset, or None when none is recorded.

    Recorded: CIFAR-10 + ResNet-18 (MoCo CIFAR demo, kNN 82.6 %, 200 epochs) and an ImageNet
    ImageFolder (``data.root`` containing "imagenet") + ResNet-50 + ``v2`` augmentation (MoCo v2,
    linear 67.5 %, 200 epochs). No MoCo number has been published for Fashion-MNIST.
    """
    d, backbone = params.data, params.model.backbone
    if d.source == "cifar10" and backbone == "resnet18":
        return _CIFAR10_R18
    if (
        d.source == "imagefolder"
        and backbone == "resnet50"
        and params.augment.preset == "v2"
        and "imagenet" in d.root.lower()
    ):
        return _IMAGENET_R50_V2
    return None


def reference_note(params: Params) -> str:
    """One sentence on what published number (if any) the results can be compared with."""
    ref = published_reference(params)
    if ref is None:
        if params.data.source == "fashion_mnist":
            return (
                "No MoCo result has been published for Fashion-MNIST: compare with the "
                "raw-pixel and random-encoder baselines instead."
            )
        return (
            f"No published reference number is recorded for {params.data.source} + "
            f"{params.model.backbone}: compare with the baselines instead."
        )
    note = (
        f"Published reference: {ref.top1:.1f} % {_PROTOCOL_NAMES[ref.protocol]} top-1 after "
        f"{ref.epochs} pretraining epochs ({ref.citation})."
    )
    if params.pretrain.epochs != ref.epochs:
        note += f" This run pretrained for {params.pretrain.epochs} epochs."
    return note


_PROTOCOL_NAMES = {"knn": "kNN", "linear": "linear-probe"}


# --------------------------------------------------------------------------- reading inputs


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None when the file is missing or not a JSON object."""
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("report: cannot read %s (%s); treated as not available", path, e)
        return None
    return obj if isinstance(obj, dict) else None


def read_tsv(path: Path) -> dict[str, np.ndarray] | None:
    """Columns of a TSV with a header row, as float arrays (empty / non-numeric cells = nan).

    Args:
        path: the TSV file.

    Returns:
        column name -> (R,) float64 values, or None when the file is missing or has no header.
    """
    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    except FileNotFoundError:
        return None
    if not lines:
        return None
    header = lines[0].split("\t")
    values = np.full((len(lines) - 1, len(header)), np.nan)  # (R, columns)
    for r, line in enumerate(lines[1:]):
        for c, cell in enumerate(line.split("\t")[: len(header)]):
            with contextlib.suppress(ValueError):
                values[r, c] = float(cell)
    return {name: values[:, c] for c, name in enumerate(header)}


def read_dvc_lock(path: Path) -> list[tuple[str, str, str]] | None:
    """The outputs recorded in ``dvc.lock`` as ``(stage, path, md5)`` rows, in file order.

    Returns:
        The rows, or None when the file is missing or not a DVC lock file.
    """
    import yaml

    try:
        lock = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, yaml.YAMLError) as e:
        log.warning("report: cannot read %s (%s)", path, e)
        return None
    stages = lock.get("stages") if isinstance(lock, dict) else None
    if not isinstance(stages, dict):
        return None
    rows = []
    for stage, entry in stages.items():
        for out in (entry or {}).get("outs") or []:
            if isinstance(out, dict) and "path" in out:
                rows.append((str(stage), str(out["path"]), str(out.get("md5", NOT_AVAILABLE))))
    return rows


def load_features(path: Path) -> dict[str, Any] | None:
    """A features file written by the embed stage, or None when missing.

    Returns:
        ``{"features": (N, D) float tensor, "labels": (N,) long tensor, "keys": [N str]}``.
    """
    import torch

    path = Path(path)
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def _shard_paths(shard_dir: Path) -> list[Path]:
    """The shards of one split: in manifest order when there is a manifest, else sorted."""
    manifest = read_json(shard_dir / "manifest.json")
    if manifest and isinstance(manifest.get("shards"), list):
        return [shard_dir / s["name"] for s in manifest["shards"] if "name" in s]
    return sorted(shard_dir.glob("*.tar"))


def load_shard_images(shard_dir: Path, keys: Iterable[str]) -> dict[str, Any]:
    """Decode the ``<key>.png`` members of the requested keys from a split's tar shards.

    Only PNG members are decoded (with PIL); nothing is unpickled. Reading stops as soon as every
    key is found.

    Args:
        shard_dir: a split directory (``data/shards/test``) holding ``*.tar`` shards.
        keys: the sample keys wanted.

    Returns:
        key -> PIL image (mode ``L`` or ``RGB``) for the keys found; missing keys are absent.
    """
    from PIL import Image

    wanted, found = set(keys), {}
    for shard in _shard_paths(Path(shard_dir)):
        if len(found) == len(wanted) or not shard.is_file():
            continue
        with tarfile.open(shard, "r") as tar:
            for member in tar:
                key = member.name[: -len(".png")]
                if member.isfile() and member.name.endswith(".png") and key in wanted:
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    image = Image.open(io.BytesIO(data))
                    image.load()
                    found[key] = image if image.mode in ("L", "RGB") else image.convert("RGB")
                    if len(found) == len(wanted):
                        break
    return found


def collect_final_metrics(root: Path) -> dict[str, float]:
    """The union of all stages' final metrics, named ``<stage>.<metric>``.

    Reads the metrics files of :data:`METRICS_FILES` that exist; nested objects flatten with
    dots; only numbers are kept (booleans and strings are dropped).

    Args:
        root: the repo root the metrics paths are relative to.

    Returns:
        e.g. ``{"pretrain.loss": 5.1, "knn.top1": 71.2, "baselines.raw_pixels_top1": 80.1}``,
        sorted by name.
    """
    out: dict[str, float] = {}

    def add(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                add(f"{prefix}.{k}", v)
        elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
            out[prefix] = float(obj)

    for prefix, rel in METRICS_FILES.items():
        add(prefix, read_json(Path(root) / rel) or {})
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- document model


@dataclass
class Table:
    """A table: ``headers`` and rows of already-formatted cells."""

    headers: list[str]
    rows: list[list[str]]


@dataclass
class Paragraph:
    """A paragraph of plain text."""

    text: str


@dataclass
class FigureRef:
    """A figure file (name inside ``figures/``) and its caption."""

    name: str
    caption: str


Block = Table | Paragraph | FigureRef


@dataclass
class Section:
    """A titled section of the report."""

    title: str
    blocks: list[Block] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        """The HTML id of the section."""
        return "".join(ch if ch.isalnum() else "-" for ch in self.title.lower()).strip("-")


def _num(d: dict[str, Any] | None, key: str) -> float | None:
    """``d[key]`` as a finite float, else None."""
    if not d or key not in d:
        return None
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _fmt(v: float | None, spec: str = ".2f", unit: str = "") -> str:
    """Format a number, or say it is not available."""
    return NOT_AVAILABLE if v is None else f"{v:{spec}}{unit}"


def _pct(d: dict[str, Any] | None, key: str) -> str:
    """A percentage with two decimals (the unit is in the column header)."""
    return _fmt(_num(d, key))


def _redact_uri(uri: str) -> str:
    """A tracking URI without user name / password."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return uri


# --------------------------------------------------------------------------- sections


def _settings_section(p: Params) -> Section:
    lr_eff = p.pretrain.lr * p.pretrain.batch_size / 256
    lin_eff = p.linear.lr * p.linear.batch_size / 256
    rows = [
        [
            "dataset",
            f"{p.data.source}"
            + (f" ({p.data.root})" if p.data.root else "")
            + (f", resized to {p.data.image_size} px" if p.data.image_size else ", native size"),
        ],
        [
            "backbone",
            f"{p.model.backbone}, width {p.model.width}, small stem "
            f"{p.model.small_stem}; {p.model.head} head -> dim {p.model.dim}",
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
        ["features", "after the projection head" if p.embed.use_head else "backbone (pre-head)"],
        ["kNN", f"k={p.knn.k}, T={p.knn.T:g}"],
        [
            "linear probe",
            f"mode {p.linear.mode}, {p.linear.epochs} epochs, batch "
            f"{p.linear.batch_size}, lr {p.linear.lr:g} per 256 (effective "
            f"{lin_eff:g}), {p.linear.lr_schedule} {list(p.linear.lr_milestones)}",
        ],
        ["seed", str(p.seed)],
    ]
    return Section("Settings", [Table(["setting", "value"], rows)])


def _results_section(p: Params, m: dict[str, dict[str, Any] | None]) -> Section:
    knn, lin, base = m["knn"], m["linear"], m["baselines"]
    k = int(_num(knn, "k") or p.knn.k)
    temp = _num(knn, "T") or p.knn.T
    augment = _num(lin, "mode_augment")  # what the probe actually ran, else the params
    lin_mode = p.linear.mode if augment is None else ("augment" if augment else "features")
    lin_epochs = int(_num(lin, "epochs") or p.linear.epochs)
    rows = [
        ["MoCo encoder + kNN", f"k={k}, T={temp:g}", _pct(knn, "top1"), _pct(knn, "top5")],
        [
            "MoCo encoder + linear probe",
            f"{lin_mode}, {lin_epochs} epochs",
            _pct(lin, "top1"),
            _pct(lin, "top5"),
        ],
        [
            "raw pixels (baseline)",
            "kNN",
            _pct(base, "raw_pixels_top1"),
            _pct(base, "raw_pixels_top5"),
        ],
        [
            "random-init encoder (baseline)",
            "kNN",
            _pct(base, "random_encoder_top1"),
            _pct(base, "random_encoder_top5"),
        ],
    ]
    ref = published_reference(p)
    if ref is not None:
        rows.append(
            [
                f"published ({ref.epochs} epochs)",
                _PROTOCOL_NAMES[ref.protocol],
                f"{ref.top1:.2f}",
                NOT_AVAILABLE,
            ]
        )
    blocks: list[Block] = [Table(["method", "protocol", "top-1 (%)", "top-5 (%)"], rows)]
    if _num(lin, "val_top1") is not None:
        blocks.append(
            Paragraph(
                f"Linear probe validation top-1 (held out of the train set): "
                f"{_pct(lin, 'val_top1')} %."
            )
        )
    gains = []
    for name, res in (("kNN", knn), ("linear", lin)):
        top1 = _num(res, "top1")
        for bname, bkey in (
            ("raw pixels", "raw_pixels_top1"),
            ("the random encoder", "random_encoder_top1"),
        ):
            b = _num(base, bkey)
            if top1 is not None and b is not None:
                gains.append(f"{name} {top1 - b:+.2f} points vs {bname}")
    if gains:
        blocks.append(Paragraph("Top-1 gains: " + "; ".join(gains) + "."))
    blocks.append(Paragraph(reference_note(p)))
    if ref is not None:
        ours = _num(knn if ref.protocol == "knn" else lin, "top1")
        if ours is not None:
            blocks.append(
                Paragraph(
                    f"This run's {_PROTOCOL_NAMES[ref.protocol]} top-1 is "
                    f"{ours - ref.top1:+.2f} points from the published number."
                )
            )
    return Section("Results", blocks)


def _pretrain_section(
    p: Params, m: dict[str, dict[str, Any] | None], root: Path, fig_dir: Path
) -> Section:
    pre, base = m["pretrain"], m["baselines"]
    sec = Section("Pretraining")
    sec.blocks.append(
        Table(
            ["metric", "value"],
            [
                ["final InfoNCE loss", _fmt(_num(pre, "loss"), ".4f")],
                [
                    "instance discrimination top-1 / top-5 (%)",
                    f"{_pct(pre, 'inst_top1')} / {_pct(pre, 'inst_top5')}",
                ],
                [
                    "steps / epochs",
                    f"{_fmt(_num(pre, 'steps'), '.0f')} / {_fmt(_num(pre, 'epochs'), '.0f')}",
                ],
                [
                    "kNN monitor top-1 at init -> end (%)",
                    f"{_pct(pre, 'knn_top1_init')} -> {_pct(pre, 'knn_top1')}",
                ],
            ],
        )
    )
    table = read_tsv(root / "plots/pretrain.tsv")
    if table is None:
        sec.blocks.append(Paragraph(f"Training curves: {NOT_AVAILABLE} (plots/pretrain.tsv)."))
    else:
        fg.plot_pretrain_curves(table, fig_dir / "pretrain_curves.png")
        sec.blocks.append(
            FigureRef(
                "pretrain_curves.png", "InfoNCE loss; learning rate and key-encoder momentum m."
            )
        )
        fg.plot_instance_accuracy(table, fig_dir / "instance_accuracy.png")
        sec.blocks.append(
            FigureRef(
                "instance_accuracy.png",
                "Instance-discrimination accuracy: "
                "the positive key ranked first (top-1) or in the top 5 of "
                "1 + K logits.",
            )
        )
        steady = None if p.moco.symmetric else p.moco.K / (2 * p.pretrain.batch_size)
        fg.plot_queue_age(table, fig_dir / "queue_age.png", steady_state=steady)
        sec.blocks.append(
            FigureRef(
                "queue_age.png",
                "Mean age (training steps) of the negative "
                "keys in the queue; the key encoder drifts during that time.",
            )
        )
        fg.plot_throughput(table, fig_dir / "throughput.png")
        sec.blocks.append(
            FigureRef(
                "throughput.png",
                "Images per second and the share of step time spent waiting for the data loader.",
            )
        )
    monitor = read_tsv(root / "plots/knn_monitor.tsv")
    if monitor is None:
        sec.blocks.append(Paragraph(f"kNN monitor: {NOT_AVAILABLE} (plots/knn_monitor.tsv)."))
    else:
        fg.plot_knn_monitor(
            monitor,
            fig_dir / "knn_monitor.png",
            random_encoder_top1=_num(base, "random_encoder_top1"),
            raw_pixels_top1=_num(base, "raw_pixels_top1"),
        )
        sec.blocks.append(
            FigureRef(
                "knn_monitor.png",
                "kNN top-1 of the monitor (on "
                "pretrain.knn_monitor_* images) per epoch, epoch 0 = random "
                "init; dashed: kNN top-1 of the baselines stage.",
            )
        )
    return sec


def _class_names(
    root: Path, p: Params, details: Sequence[dict[str, Any] | None], num_classes: int
) -> list[str]:
    """Class names from the test-shard manifest, else the details files, else the indices."""
    if is_url(p.data.shards_dir):
        try:
            manifest = read_manifest(shards_location(p.data.shards_dir) / "test")
        except ShardError:
            manifest = None
    else:
        manifest = read_json(root / p.data.shards_dir / "test" / "manifest.json")
    for src in [manifest, *details]:
        names = (src or {}).get("class_names")
        if isinstance(names, list) and len(names) >= num_classes:
            return [str(n) for n in names]
    return [str(i) for i in range(num_classes)]


def _evaluation_section(root: Path, fig_dir: Path) -> Section:
    sec = Section("Evaluation")
    lin_table = read_tsv(root / "plots/linear.tsv")
    if lin_table is None:
        sec.blocks.append(Paragraph(f"Linear-probe curves: {NOT_AVAILABLE} (plots/linear.tsv)."))
    else:
        fg.plot_linear_curves(lin_table, fig_dir / "linear_curves.png")
        sec.blocks.append(
            FigureRef(
                "linear_curves.png",
                "Linear probe on frozen features: loss, lr schedule and accuracy per epoch.",
            )
        )
    per_class: dict[str, list[float]] = {}
    names: list[str] | None = None
    for label, stem in (("kNN", "knn"), ("linear", "linear")):
        det = read_json(root / f"eval/{stem}_details.json")
        if det is None or "confusion_matrix" not in det:
            sec.blocks.append(
                Paragraph(f"{label} confusion matrix: {NOT_AVAILABLE} (eval/{stem}_details.json).")
            )
            continue
        cm = np.asarray(det["confusion_matrix"], dtype=np.int64)
        det_names = [str(n) for n in det.get("class_names") or range(len(cm))]
        fg.plot_confusion(
            cm,
            det_names,
            fig_dir / f"confusion_{stem}.png",
            title=f"{label} confusion matrix (test set)",
        )
        sec.blocks.append(
            FigureRef(
                f"confusion_{stem}.png",
                f"{label}: rows = true class, colour = % of the true class, numbers = counts.",
            )
        )
        acc = det.get("per_class_accuracy")
        if isinstance(acc, list) and len(acc) == len(det_names) and names in (None, det_names):
            names = det_names
            per_class[label] = [float(a) for a in acc]
    if names is not None:
        fg.plot_per_class_accuracy(names, per_class, fig_dir / "per_class_accuracy.png")
        sec.blocks.append(FigureRef("per_class_accuracy.png", "Per-class top-1 accuracy."))
    return sec


def _embedding_section(p: Params, root: Path, fig_dir: Path) -> Section:
    sec = Section("Embeddings")
    test = load_features(root / "features/test.pt")
    train = load_features(root / "features/train.pt")
    details = [read_json(root / f"eval/{s}_details.json") for s in ("knn", "linear")]
    num_classes = max(
        (int(f["labels"].max()) + 1 for f in (test, train) if f is not None and len(f["labels"])),
        default=0,
    )
    names = _class_names(root, p, details, num_classes)
    if test is None:
        sec.blocks.append(Paragraph(f"t-SNE: {NOT_AVAILABLE} (features/test.pt)."))
    elif (
        fg.plot_tsne(
            test["features"],
            test["labels"],
            names,
            fig_dir / "tsne.png",
            num_points=p.report.tsne_points,
            seed=p.seed,
        )
        is not None
    ):
        sec.blocks.append(
            FigureRef(
                "tsne.png",
                f"t-SNE of up to {p.report.tsne_points} test "
                "embeddings (L2-normalised), coloured by class.",
            )
        )
    else:
        sec.blocks.append(
            Paragraph(
                f"t-SNE: skipped (report.tsne_points = "
                f"{p.report.tsne_points}, {len(test['labels'])} test "
                f"embeddings; at least {fg.MIN_TSNE_POINTS} needed)."
            )
        )
    sec.blocks.append(_retrieval_block(p, root, fig_dir, test, train, names))
    return sec


def _retrieval_block(
    p: Params,
    root: Path,
    fig_dir: Path,
    test: dict[str, Any] | None,
    train: dict[str, Any] | None,
    names: list[str],
) -> Block:
    if p.report.retrieval_queries == 0:
        return Paragraph("Retrieval: skipped (report.retrieval_queries = 0).")
    if test is None or train is None:
        return Paragraph(f"Retrieval: {NOT_AVAILABLE} (features/test.pt, features/train.pt).")
    if is_url(p.data.shards_dir):
        return Paragraph(f"Retrieval: {NOT_AVAILABLE} (it reads local shards; data.shards_dir "
                         f"is the URL {p.data.shards_dir}).")
    shards = root / p.data.shards_dir
    if not (shards / "test").is_dir() or not (shards / "train").is_dir():
        return Paragraph(f"Retrieval: {NOT_AVAILABLE} (shards in {p.data.shards_dir}).")
    q_idx = fg.seeded_subsample(len(test["labels"]), p.report.retrieval_queries, p.seed)
    nn_idx, nn_sim = fg.nearest_neighbours(
        test["features"][q_idx], train["features"], p.report.retrieval_neighbours
    )  # (Q, k) each
    q_keys = [test["keys"][i] for i in q_idx]
    n_keys = [[train["keys"][j] for j in row] for row in nn_idx.tolist()]
    q_img = load_shard_images(shards / "test", q_keys)
    n_img = load_shard_images(shards / "train", [k for row in n_keys for k in row])
    if not q_img and not n_img:
        return Paragraph(f"Retrieval: {NOT_AVAILABLE} (no images of the keys in the shards).")
    fg.plot_retrieval(
        [q_img.get(k) for k in q_keys],
        test["labels"][q_idx].tolist(),
        [[n_img.get(k) for k in row] for row in n_keys],
        train["labels"][nn_idx].tolist(),
        nn_sim.tolist(),
        names,
        fig_dir / "retrieval.png",
    )
    return FigureRef(
        "retrieval.png",
        f"{len(q_keys)} random test images (left) and their "
        f"{nn_idx.shape[1]} nearest training images by cosine similarity of the "
        "frozen features; green = same class, red = different class.",
    )


def _cost_section(m: dict[str, dict[str, Any] | None]) -> Section:
    pre = m["pretrain"]
    notes = {
        "pretrain": ", ".join(
            x
            for x in [
                f"data wait {100 * _num(pre, 'data_wait_fraction'):.1f} %"
                if _num(pre, "data_wait_fraction") is not None
                else "",
                f"peak memory {_num(pre, 'peak_memory_bytes') / 2**20:.0f} MiB"
                if _num(pre, "peak_memory_bytes") is not None
                else "",
                f"{_num(pre, 'world_size'):.0f} process(es)"
                if _num(pre, "world_size") is not None
                else "",
            ]
            if x
        ),
        "knn": (
            f"{_num(m['knn'], 'num_train'):.0f} train / {_num(m['knn'], 'num_test'):.0f} test"
            if _num(m["knn"], "num_train") is not None and _num(m["knn"], "num_test") is not None
            else ""
        ),
        "linear": (
            f"batch {_num(m['linear'], 'batch_size'):.0f}, effective lr "
            f"{_num(m['linear'], 'lr_effective'):g}"
            if _num(m["linear"], "batch_size") is not None
            and _num(m["linear"], "lr_effective") is not None
            else ""
        ),
    }
    rows, total = [], 0.0
    for stage in ("pretrain", "embed", "baselines", "knn", "linear"):
        d = m[stage]
        wall = _num(d, "wall_time_s")
        total += wall or 0.0
        ips = _num(d, "images_per_s")
        rows.append(
            [
                stage,
                _fmt(wall, ".1f"),
                "" if d and ips is None else _fmt(ips, ".1f"),
                notes.get(stage, "") if d else NOT_AVAILABLE,
            ]
        )
    rows.append(["total (available)", f"{total:.1f}", "", ""])
    return Section(
        "Throughput and wall time", [Table(["stage", "wall time (s)", "images / s", "notes"], rows)]
    )


def _runs_section(root: Path) -> Section:
    rows, uris = [], []
    for stage in TRACKED_STAGES:
        run = read_json(root / "runs" / f"{stage}.json")
        if run is None:
            rows.append([stage, NOT_AVAILABLE, ""])
            continue
        rid = run.get("run_id")
        rows.append(
            [
                stage,
                str(rid) if rid else "not logged (MLflow disabled)",
                str(run.get("experiment_id") or ""),
            ]
        )
        uri = run.get("tracking_uri")
        if uri and _redact_uri(str(uri)) not in uris:
            uris.append(_redact_uri(str(uri)))
    blocks: list[Block] = [Table(["stage", "MLflow run id", "experiment id"], rows)]
    blocks.append(Paragraph("Tracking URI: " + (", ".join(uris) if uris else NOT_AVAILABLE) + "."))
    return Section("MLflow runs", blocks)


def _lock_section(root: Path) -> Section:
    rows = read_dvc_lock(root / "dvc.lock")
    if rows is None:
        return Section("DVC outputs", [Paragraph(f"dvc.lock: {NOT_AVAILABLE}.")])
    return Section(
        "DVC outputs",
        [
            Paragraph("Output hashes recorded in dvc.lock (md5; '.dir' = a directory listing)."),
            Table(["stage", "output", "md5"], [list(r) for r in rows]),
        ],
    )


# --------------------------------------------------------------------------- rendering


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def render_html(title: str, subtitle: str, sections: Sequence[Section], fig_dir: Path) -> str:
    """The self-contained HTML page (figures read from ``fig_dir`` and inlined as base64)."""
    parts = []
    for sec in sections:
        parts.append(f'<section id="{sec.anchor}">\n<h2>{html.escape(sec.title)}</h2>')
        for b in sec.blocks:
            if isinstance(b, Paragraph):
                cls = ' class="na"' if NOT_AVAILABLE in b.text else ""
                parts.append(f"<p{cls}>{html.escape(b.text)}</p>")
            elif isinstance(b, Table):
                head = "".join(f"<th>{html.escape(h)}</th>" for h in b.headers)
                body = "\n".join(
                    "<tr>"
                    + "".join(
                        f'<td class="{"num" if _is_number(c) else "na"}">{html.escape(c)}</td>'
                        if _is_number(c) or c == NOT_AVAILABLE
                        else f"<td>{html.escape(c)}</td>"
                        for c in row
                    )
                    + "</tr>"
                    for row in b.rows
                )
                parts.append(
                    f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>"
                )
            else:
                data = base64.b64encode((fig_dir / b.name).read_bytes()).decode("ascii")
                cap = html.escape(b.caption)
                parts.append(
                    f'<figure>\n<img src="data:image/png;base64,{data}" alt="{cap}">\n'
                    f"<figcaption>{cap}</figcaption>\n</figure>"
                )
        parts.append("</section>")
    nav = "\n".join(f'<li><a href="#{s.anchor}">{html.escape(s.title)}</a></li>' for s in sections)
    template = resources.files("pipeline.report").joinpath("template.html").read_text("utf-8")
    return Template(template).substitute(
        title=html.escape(title), subtitle=html.escape(subtitle), nav=nav, body="\n".join(parts)
    )


def _md_cell(text: str) -> str:
    return text.replace("|", r"\|").replace("\n", " ")


def render_markdown(title: str, subtitle: str, sections: Sequence[Section]) -> str:
    """The Markdown report (same tables; figures linked relative as ``figures/<name>``)."""
    out = [f"# {title}", "", subtitle, ""]
    for sec in sections:
        out += [f"## {sec.title}", ""]
        for b in sec.blocks:
            if isinstance(b, Paragraph):
                out += [b.text, ""]
            elif isinstance(b, Table):
                out.append("| " + " | ".join(_md_cell(h) for h in b.headers) + " |")
                out.append("|" + "|".join("---" for _ in b.headers) + "|")
                out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
                out.append("")
            else:
                out += [f"![{_md_cell(b.caption)}](figures/{b.name})", "", f"*{b.caption}*", ""]
    return "\n".join(out)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished directory ``src`` to ``dst``, replacing an existing ``dst``.

    Two renames inside one parent directory: ``dst`` is briefly absent, never half-written.
    """
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.old."))
        os.rename(dst, old / dst.name)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_report(
    *, params: Params, root: Path, out_dir: Path, git_commit: str | None = None
) -> Path:
    """Read the pipeline outputs below ``root`` and write the report to ``out_dir``.

    Args:
        params: the validated run params (settings table, t-SNE / retrieval sizes, seed,
            ``data.shards_dir``, published-reference lookup).
        root: the repo root every input path is relative to.
        out_dir: the report directory; replaced as a whole (rendered beside it, then renamed).
        git_commit: shown in the header when given (no wall-clock time is written).

    Returns:
        The path of ``out_dir/report.html``.
    """
    root, out_dir = Path(root), Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a report is meant to be read
        fig_dir = tmp / "figures"
        fig_dir.mkdir()
        metrics = {stage: read_json(root / rel) for stage, rel in METRICS_FILES.items()}
        sections = [
            _settings_section(params),
            _results_section(params, metrics),
            _pretrain_section(params, metrics, root, fig_dir),
            _evaluation_section(root, fig_dir),
            _embedding_section(params, root, fig_dir),
            _cost_section(metrics),
            _runs_section(root),
            _lock_section(root),
        ]
        title = f"MoCo report: {params.data.source} / {params.model.backbone}"
        subtitle = (
            f"MoCo {'v2' if params.model.head == 'mlp' else 'v1'}-style pretraining, "
            f"{params.pretrain.epochs} epochs; git commit "
            f"{git_commit or NOT_AVAILABLE}."
        )
        (tmp / "report.html").write_text(
            render_html(title, subtitle, sections, fig_dir), encoding="utf-8"
        )
        (tmp / "report.md").write_text(render_markdown(title, subtitle, sections), encoding="utf-8")
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir / "report.html"


# --------------------------------------------------------------------------- checking


class _ImgCollector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.srcs.append(dict(attrs).get("src"))


def _check_data_uri(src: str) -> str | None:
    """None when a ``data:`` URI decodes to a non-empty payload (a PNG when it says so)."""
    header, sep, payload = src[len("data:") :].partition(",")
    if not sep:
        return "data URI without ','"
    if header.endswith(";base64"):
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            return f"data URI is not valid base64 ({e})"
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if not data:
        return "data URI is empty"
    if header.startswith("image/png") and not data.startswith(PNG_SIGNATURE):
        return "data URI says image/png but is not a PNG"
    return None


def check_html(path: Path) -> list[str]:
    """Problems with the images of an HTML file (empty list = every image can be shown).

    Each ``<img src>`` must be a ``data:`` URI that decodes (to a PNG when it is labelled
    ``image/png``) or a local file that exists relative to the HTML file. Remote URLs count as
    problems: the report must be self-contained.

    Args:
        path: the HTML file.

    Returns:
        One message per problem, naming the image by its position (``img #1`` ...).
    """
    path = Path(path)
    if not path.is_file():
        return [f"{path}: file does not exist"]
    parser = _ImgCollector()
    parser.feed(path.read_text(encoding="utf-8"))
    problems = []
    for i, src in enumerate(parser.srcs, start=1):
        if not src:
            problems.append(f"img #{i}: no src")
        elif src.startswith("data:"):
            err = _check_data_uri(src)
            if err:
                problems.append(f"img #{i}: {err}")
        elif urllib.parse.urlsplit(src).scheme:
            problems.append(f"img #{i}: remote or non-file URL {src[:80]!r} (not self-contained)")
        else:
            rel = urllib.parse.unquote(urllib.parse.urlsplit(src).path)
            if not (path.parent / rel).is_file():
                problems.append(f"img #{i}: file {rel!r} does not exist next to {path.name}")
    return problems
