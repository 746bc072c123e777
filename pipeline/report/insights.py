"""The report's "What the embeddings say about the data": near-duplicates and outliers.

Reads ``eval/data_insights.json`` (the ``data_insights`` stage, :mod:`pipeline.evaluate.run.
data_insights`) and shows the most similar pairs of pretraining images side by side with their
cosine and keys, and the images farthest from all others as a grid, each image read back from
its shard (:func:`pipeline.report.inputs.shard_images`; an image on a URL is drawn as a
"missing" tile: the report reads local files only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.remote import is_url
from pipeline.report import figures as fg
from pipeline.report.document import NOT_AVAILABLE, Block, FigureRef, Paragraph, Section, Table
from pipeline.report.inputs import RunOutputs, shard_images

TITLE = "What the embeddings say about the data"
PAIRS_PER_ROW = 3  # pairs side by side in one figure row (6 tiles)
OUTLIERS_PER_ROW = 6
KEY_CHARS = 18  # a key longer than this is cut in the figures (the tables show it whole)
PAIR_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")


def _short(key: str) -> str:
    return key if len(key) <= KEY_CHARS else "…" + key[-(KEY_CHARS - 1):]


def load_images(root: Path, items: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], Any]:
    """The images of ``{"key", "shard"}`` items, read from their local shards, by (shard, key).

    A shard path recorded relative to the repo root is read below ``root``; a URL is skipped.
    """
    wanted: dict[str, set[str]] = {}
    for it in items:
        if not is_url(it["shard"]):
            wanted.setdefault(it["shard"], set()).add(it["key"])
    found: dict[tuple[str, str], Any] = {}
    for shard, keys in wanted.items():
        path = Path(shard) if Path(shard).is_absolute() else Path(root) / shard
        found.update({(shard, k): im for k, im in shard_images(path, keys).items()})
    return found


def _frame(ax: Any, colour: str) -> None:
    for spine in ax.spines.values():
        spine.set(edgecolor=colour, linewidth=3)


def plot_pairs(pairs: Sequence[Mapping[str, Any]], images: Mapping[tuple[str, str], Any],
               path: Path) -> Path:
    """Near-duplicate pairs side by side, :data:`PAIRS_PER_ROW` per row, framed alike.

    Args:
        pairs: ``{"cosine", "a": {"key", "shard"}, "b": {...}}`` items, most similar first.
        images: ``(shard, key)`` -> PIL image (:func:`load_images`); absent = "missing" tile.
        path: the PNG to write.

    Returns:
        ``path``.
    """
    rows = math.ceil(len(pairs) / PAIRS_PER_ROW)
    fig, axes = fg._figure(2.0 * PAIRS_PER_ROW * 2, 2.1 * rows, ncols=2 * PAIRS_PER_ROW,
                           nrows=rows)
    for ax in axes[2 * len(pairs):]:
        ax.axis("off")
    for n, pair in enumerate(pairs):
        colour = PAIR_COLOURS[n % len(PAIR_COLOURS)]
        for side, ax in zip("ab", axes[2 * n: 2 * n + 2]):
            item = pair[side]
            fg._show_image(ax, images.get((item["shard"], item["key"])))
            ax.set_xlabel(_short(item["key"]), fontsize=7)
            _frame(ax, colour)
        axes[2 * n].set_title(f"#{n + 1}  cosine {pair['cosine']:.4f}", fontsize=8, loc="left",
                              color=colour)
    return fg._save(fig, path)


def plot_outliers(outliers: Sequence[Mapping[str, Any]],
                  images: Mapping[tuple[str, str], Any], path: Path) -> Path:
    """The oddest images in a grid, each titled with its outlier score (and reason).

    Args:
        outliers: ``{"key", "shard", "score"}`` items (``"reason"`` too since the views),
            highest score first.
        images: ``(shard, key)`` -> PIL image (:func:`load_images`).
        path: the PNG to write.

    Returns:
        ``path``.
    """
    rows = math.ceil(len(outliers) / OUTLIERS_PER_ROW)
    fig, axes = fg._figure(1.7 * OUTLIERS_PER_ROW, 2.0 * rows, ncols=OUTLIERS_PER_ROW,
                           nrows=rows)
    for ax in axes[len(outliers):]:
        ax.axis("off")
    for n, (item, ax) in enumerate(zip(outliers, axes)):
        fg._show_image(ax, images.get((item["shard"], item["key"])))
        ax.set_title(f"#{n + 1}  {item['score']:.1f}  {item.get('reason', '')}", fontsize=7)
        ax.set_xlabel(_short(item["key"]), fontsize=7)
    return fg._save(fig, path)


def _summary(ins: Mapping[str, Any]) -> str:
    parts = ins.get("parts") or {}
    where = (f" ({parts.get('built', 0)} built, {parts.get('read_in_place', 0)} read in place "
             "from data.pretrain_shards)" if parts.get("read_in_place") else "")
    in_pairs = ins.get("images_in_pairs")
    return (f"{ins['images']:,} pretraining images{where}, embedded with the exported encoder "
            f"(global pool of the last stage, eval transform), each compared with its "
            f"{ins['k']} most cosine-similar others. {ins['duplicate_pairs']:,} pairs reach "
            f"cosine >= {ins['duplicate_cosine']:g} (insights.duplicate_cosine), involving "
            f"{NOT_AVAILABLE if in_pairs is None else f'{in_pairs:,}'} images. No labels are "
            "used.")


IDENTICAL = "identical"


def pixel_difference(a: Any, b: Any) -> tuple[str, int | None]:
    """How the pixels of two images differ, in words, and how many pixels differ.

    Images of different modes are compared in RGB (a grey image as three equal channels); a
    pixel differs when any channel does, by the largest channel difference.

    Args:
        a: a PIL image, or None (not read).
        b: the other.

    Returns:
        (:data:`IDENTICAL` or ``"N of M pixels differ, by up to G grey levels"`` (``levels``
        for colour images), the count N); (``"sizes differ (WxH, WxH)"``, None) or
        (``"not available (...)"``, None) when the pixels cannot be compared.
    """
    if a is None or b is None:
        return f"{NOT_AVAILABLE} (image not read from a local shard)", None
    if a.size != b.size:
        return f"sizes differ ({a.width}x{a.height}, {b.width}x{b.height})", None
    if a.mode != b.mode:
        a, b = a.convert("RGB"), b.convert("RGB")
    diff = np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16))  # (H, W[, C])
    per_pixel = diff.max(axis=2) if diff.ndim == 3 else diff  # (H, W)
    n = int(np.count_nonzero(per_pixel))
    if n == 0:
        return IDENTICAL, 0
    levels = "grey levels" if a.mode == "L" else "levels"
    return (f"{n:,} of {per_pixel.size:,} pixels differ, by up to {int(per_pixel.max())} "
            f"{levels}"), n


def _pairs_caption(pairs: Sequence[Mapping[str, Any]], total: int, counts: list[int | None]
                   ) -> str:
    """The duplicates figure's caption: how many of the pairs shown have the same pixels."""
    same = sum(c == 0 for c in counts)
    differ = sum(c is not None and c > 0 for c in counts)
    unknown = len(counts) - same - differ
    pixels = (f"{same} of them with identical pixels, {differ} differing in some pixels"
              + (f", {unknown} not compared" if unknown else "")
              + " (the table: how many pixels, by how much)")
    return (f"The {len(pairs)} most similar of the {total:,} near-duplicate pairs, side by side "
            f"(same frame colour = one pair), with their cosine and keys: {pixels}. The "
            "cosine is of the encoder's features: near 1 means the encoder cannot tell the two "
            "apart, not that their pixels are equal.")


def _pair_blocks(ins: Mapping[str, Any], shown: int, root: Path, fig_dir: Path) -> list[Block]:
    pairs = list(ins["pairs"])[:shown]
    if not pairs:
        return [Paragraph(f"Near-duplicates: no pair reaches cosine >= "
                          f"{ins['duplicate_cosine']:g}.")]
    images = load_images(root, [p[s] for p in pairs for s in "ab"])
    plot_pairs(pairs, images, fig_dir / "duplicates.png")
    diffs = [pixel_difference(*(images.get((p[s]["shard"], p[s]["key"])) for s in "ab"))
             for p in pairs]
    rows = [[str(n + 1), f"{p['cosine']:.4f}", p["a"]["key"], p["b"]["key"], diff,
             p["a"]["shard"] if p["a"]["shard"] == p["b"]["shard"]
             else f"{p['a']['shard']} / {p['b']['shard']}"]
            for n, (p, (diff, _)) in enumerate(zip(pairs, diffs))]
    return [
        FigureRef("duplicates.png", _pairs_caption(pairs, ins["duplicate_pairs"],
                                                   [c for _, c in diffs])),
        Table(["#", "cosine", "key", "key", "pixels", "shard"], rows),
    ]


def _outlier_blocks(ins: Mapping[str, Any], shown: int, root: Path,
                    fig_dir: Path) -> list[Block]:
    outliers = list(ins["outliers"])[:shown]
    if not outliers:
        return []
    plot_outliers(outliers, load_images(root, outliers), fig_dir / "outliers.png")
    med = (ins.get("outlier_score") or {}).get("median")
    typical = f"; the typical image scores {med:.3f} (median)" if med is not None else ""
    return [FigureRef(
        "outliers.png",
        f"The {len(outliers)} oddest images: the score above each is the largest of its robust "
        "z-scores (MADs from the set's median) in five views: far from its "
        f"{ins['k']} nearest neighbours in the embedding or in the first stage's tone and "
        "texture statistics (low_level), or near-constant, noise-like or mostly one flat level "
        f"in its pixels; the view named is the one that gave it{typical}. Blank, noise, text, "
        "cut-off or off-topic images tend to come first.")]


def insights_section(outputs: RunOutputs, shown: int, fig_dir: Path) -> Section:
    """Near-duplicate pairs and outliers of the pretraining images.

    Args:
        outputs: the run's outputs (``data_insights``, ``root``).
        shown: pairs and outliers shown, each (``report.insight_images``).
        fig_dir: where ``duplicates.png`` and ``outliers.png`` are drawn.

    Returns:
        The section (a "not available" paragraph without ``eval/data_insights.json``).
    """
    sec = Section(TITLE)
    ins = outputs.data_insights
    if ins is None:
        sec.blocks.append(Paragraph(f"Near-duplicates and outliers: {NOT_AVAILABLE} "
                                    "(eval/data_insights.json)."))
        return sec
    sec.blocks.append(Paragraph(_summary(ins)))
    if shown == 0:
        sec.blocks.append(Paragraph("Thumbnails: skipped (report.insight_images = 0)."))
    else:
        sec.blocks += _pair_blocks(ins, shown, outputs.root, fig_dir)
        sec.blocks += _outlier_blocks(ins, shown, outputs.root, fig_dir)
    sec.blocks.append(Paragraph(f"Every count, and up to {len(ins['pairs'])} pairs and "
                                f"{len(ins['outliers'])} outliers with their keys and shards: "
                                "eval/data_insights.json (docs/insights.md: how to read them)."))
    return sec
