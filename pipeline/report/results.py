"""The report's results: MoCo's top-1 beside the baselines, each row naming its features.

Every number set beside another says what it shares with it and what differs (features, kNN
k and T), so a gain is never read off two different protocols without saying so:
:func:`results_section` (the table, the headline, the gains and the published number).
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.config import Params
from pipeline.evaluate.knn import DEFAULT_K, DEFAULT_T
from pipeline.report.document import NOT_AVAILABLE, Paragraph, Section, Table, fmt
from pipeline.report.inputs import Metrics, metric
from pipeline.report.references import PROTOCOL_NAMES, published_reference, reference_note

KNN_PROTOCOL = f"k={DEFAULT_K}, T={DEFAULT_T:g}"  # the InstDisc / MoCo CIFAR demo kNN


def pct(m: Metrics | None, key: str) -> str:
    """A percentage with two decimals (the unit is in the column header)."""
    return fmt(metric(m, key))


GLOBAL_POOL = "last stage, global pool"  # the MoCo protocol's features (and the monitor's)
PIXELS = "pixels"


def _pooled(layer: int, grid: int) -> str:
    """Short words for backbone features pooled at stage ``layer`` to a ``grid`` x ``grid`` map."""
    stage = "last stage" if layer == 4 else f"layer{layer}"
    return f"{stage}, global pool" if grid == 1 else f"{stage}, {grid} x {grid} cells"


def moco_features(p: Params) -> str:
    """What the kNN and linear stages score: the embed stage's features, in short words."""
    return "projection head" if p.embed.use_head else _pooled(p.embed.layer, p.embed.pool_grid)


def random_features(p: Params) -> str:
    """The random-init encoder's features (the baselines stage pools as embed, never a head)."""
    return _pooled(p.embed.layer, p.embed.pool_grid)


def _moco_knn_protocol(p: Params, knn: Metrics | None) -> tuple[int, float, str]:
    """k, T of MoCo's kNN as it ran (else the params) and the words for the table."""
    k = int(metric(knn, "k") or p.knn.k)
    temp = metric(knn, "T") or p.knn.T
    chosen = " (chosen on a validation split of train)" if metric(knn, "select_val") else ""
    return k, temp, f"k={k}, T={temp:g}{chosen}"


def _results_rows(p: Params, m: Mapping[str, Metrics | None]) -> list[list[str]]:
    """Long because each row of the results table is spelled out, with its features."""
    knn, lin, base = m["knn"], m["linear"], m["baselines"]
    augment = metric(lin, "mode_augment")  # what the probe actually ran, else the params
    lin_mode = p.linear.mode if augment is None else ("augment" if augment else "features")
    lin_epochs = int(metric(lin, "epochs") or p.linear.epochs)
    ours = moco_features(p)
    rows = [
        ["MoCo encoder + kNN", ours, _moco_knn_protocol(p, knn)[2], pct(knn, "top1"),
         pct(knn, "top5")],
        ["MoCo encoder + linear probe", ours, f"{lin_mode}, {lin_epochs} epochs",
         pct(lin, "top1"), pct(lin, "top5")],
        ["raw pixels (baseline)", PIXELS, f"kNN, {KNN_PROTOCOL}", pct(base, "raw_pixels_top1"),
         pct(base, "raw_pixels_top5")],
    ]
    if metric(knn, "protocol_top1") is not None:  # the published protocol, beside ours
        rows.insert(1, ["MoCo encoder + kNN, MoCo protocol", GLOBAL_POOL, KNN_PROTOCOL,
                        pct(knn, "protocol_top1"), pct(knn, "protocol_top5")])
    if metric(lin, "protocol_top1") is not None:
        rows.insert(len(rows) - 1, ["MoCo encoder + linear probe, MoCo protocol", GLOBAL_POOL,
                                    "raw features, lr 30, 100 epochs",
                                    pct(lin, "protocol_top1"), pct(lin, "protocol_top5")])
    tk, tt = metric(base, "raw_pixels_knn_tuned_k"), metric(base, "raw_pixels_knn_tuned_T")
    if tk is not None and tt is not None:
        rows.append(["raw pixels (baseline)", PIXELS,
                     f"kNN, k={int(tk)}, T={tt:g} (chosen on a validation split of train)",
                     pct(base, "raw_pixels_knn_tuned_top1"),
                     pct(base, "raw_pixels_knn_tuned_top5")])
    if metric(base, "raw_pixels_linear_top1") is not None:
        rows.append(["raw pixels (baseline)", PIXELS,
                     f"linear probe, features, {lin_epochs} epochs",
                     pct(base, "raw_pixels_linear_top1"), pct(base, "raw_pixels_linear_top5")])
    rows.append(["random-init encoder (baseline)", random_features(p), f"kNN, {KNN_PROTOCOL}",
                 pct(base, "random_encoder_top1"), pct(base, "random_encoder_top5")])
    ref = published_reference(p)
    if ref is not None:
        rows.append([f"published ({ref.epochs} epochs)", GLOBAL_POOL,
                     PROTOCOL_NAMES[ref.protocol], f"{ref.top1:.2f}", NOT_AVAILABLE])
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
                               f"{pct(knn, 'val_top1')} %."))
    if metric(lin, "val_top1") is not None:
        notes.append(Paragraph(f"Linear probe validation top-1 (held out of the train set): "
                               f"{pct(lin, 'val_top1')} %."))
    gains = []
    best = best_pixel_baselines(base)
    for name, res in (("kNN", knn), ("linear", lin)):
        top1 = metric(res, "top1")
        against = [(f"the best raw-pixel {name}", best[name])]
        if name == "kNN":  # the random encoder is only kNN-scored: same protocol only
            against.append((f"the random encoder's kNN ({_random_versus(p, knn)})",
                            metric(base, "random_encoder_top1")))
        for bname, b in against:
            if top1 is not None and b is not None:
                gains.append(f"{name} {top1 - b:+.2f} points vs {bname}")
    if gains:
        notes.append(Paragraph("Top-1 gains: " + "; ".join(gains) + "."))
    notes.append(Paragraph(reference_note(p)))
    ref = published_reference(p)
    res = None if ref is None else (knn if ref.protocol == "knn" else lin)
    protocol, ours = metric(res, "protocol_top1"), metric(res, "top1")
    if ref is not None and (protocol is not None or ours is not None):
        name = PROTOCOL_NAMES[ref.protocol]
        text = (f"This run's {name} top-1 in the MoCo protocol ({GLOBAL_POOL}, as published) is "
                f"{protocol - ref.top1:+.2f}" if protocol is not None else
                f"This run's {name} top-1 on its own features ({moco_features(p)}; published: "
                f"{GLOBAL_POOL}) is {ours - ref.top1:+.2f}")  # type: ignore[operator]
        notes.append(Paragraph(text + " points from the published number."))
    return notes


def _random_versus(p: Params, knn: Metrics | None) -> str:
    """What the random encoder's kNN shares with MoCo's, and what differs, in words."""
    k, temp, _ = _moco_knn_protocol(p, knn)
    same_features = moco_features(p) == random_features(p)
    same_knn = (k, temp) == (DEFAULT_K, DEFAULT_T)
    if same_features and same_knn:
        return "same features and kNN"
    feats = ("same features" if same_features else
             f"features {random_features(p)} against MoCo's {moco_features(p)}")
    return feats + ("" if same_knn else f"; {KNN_PROTOCOL} against MoCo's k={k}, T={temp:g}")


def results_section(p: Params, m: Mapping[str, Metrics | None]) -> Section:
    """The results table (MoCo kNN / linear, baselines, published number) and the gains."""
    table = Table(["method", "features", "protocol", "top-1 (%)", "top-5 (%)"],
                  _results_rows(p, m))
    head = headline(m)
    return Section("Results", [*([Paragraph(head)] if head else []), table,
                               *_results_notes(p, m)])
