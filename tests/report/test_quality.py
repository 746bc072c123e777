"""The report's quality sections: label-free numbers and the label-efficiency margin."""

from __future__ import annotations

import copy

from helpers import says
from reporthelpers import LABEL_EFFICIENCY, make_run

from pipeline.atomic import read_json, write_json
from pipeline.report import labelfree_findings as labelfree
from pipeline.report.document import NOT_AVAILABLE, FigureRef, Paragraph, Table
from pipeline.report.inputs import read_outputs
from pipeline.report.quality import label_efficiency_section, labelfree_section, margin_sentence


def test_margin_sentence__beats_raw_pixels_by_more_than_the_spread():
    # kNN 60.5 vs 40.0 (+20.5 > 2 + 3), linear 70.0 vs 45.0 (+25 > 2 + 3), by hand
    text = margin_sentence(LABEL_EFFICIENCY["curve"])
    assert text == (
        "With 10 labelled images per class: kNN 60.50 % against 40.00 % (+20.50 points; "
        "spread over draws 2.00 and 3.00); linear probe 70.00 % against 45.00 % (+25.00 points; "
        "spread over draws 2.00 and 3.00). MoCo beats raw pixels by more than the spread of "
        "the draws.")


def test_margin_sentence__says_so_when_moco_does_not_beat_raw_pixels():
    curve = copy.deepcopy(LABEL_EFFICIENCY["curve"])
    curve["moco"]["knn"]["10"]["mean"] = 44.0  # +4 < 2 + 3
    curve["moco"]["linear"]["10"]["mean"] = 40.0  # below
    assert margin_sentence(curve).endswith(
        "MoCo does NOT beat raw pixels by more than the spread of the draws.")


def test_quality_sections__verdict_first_tables_figures_and_study_roles(tmp_path, monkeypatch):
    root = make_run(tmp_path / "run")
    pre = read_json(root / "eval/metrics/pretrain.json")
    write_json(root / "eval/metrics/pretrain.json", {**pre, "verdict_code": 1, "verdict_epoch": 2})
    out = read_outputs(root, "data/shards")
    figs = tmp_path / "figs"
    figs.mkdir()
    monkeypatch.setattr(labelfree, "STUDY", {"rankme": (0.81, 20), "alignment": (0.5, 20),
                                             "uniformity": (-0.2, 20)})
    monkeypatch.setattr(labelfree, "WITHIN_RUN", {"rankme": (0.93, 3)})
    sec = labelfree_section(out, figs)
    texts = [b.text for b in sec.blocks if isinstance(b, Paragraph)]
    assert sec.blocks[0] == Paragraph(texts[0])  # the verdict comes first
    says(texts[0], "Verdict without labels: plateaued since epoch 2", "since epoch 2")
    table = next(b for b in sec.blocks if isinstance(b, Table))
    assert table.rows[0] == ["RankMe (effective rank)", "12.500", "41.250",
                             labelfree.ROLE["rankme"]]
    # a run older than view top-1 has none: n/a in the table, no panel
    assert table.rows[3][:3] == ["view top-1 (%)", NOT_AVAILABLE, NOT_AVAILABLE]
    says(texts[1], "along the epochs of 3 full-length runs", "+0.93",
         "across 20 encoders of 3-epoch runs, +0.81", labelfree.ROLE["rankme"])
    says(texts[2], "across 20 encoders of 3-epoch runs, +0.50")
    assert texts[4].endswith("Not yet checked against accuracy on this project's data.")
    assert (figs / "labelfree.png").is_file()
    le = label_efficiency_section(out, figs)
    assert [b.name for b in le.blocks if isinstance(b, FigureRef)] == ["label_efficiency.png"]
    rows = next(b for b in le.blocks if isinstance(b, Table)).rows
    assert rows[0] == ["MoCo", "knn", "30.00 ± 2.00", "60.50 ± 2.00"]


def test_quality_sections__no_verdict_says_so_and_why(tmp_path):
    out = read_outputs(make_run(tmp_path / "run"), "data/shards")  # metrics without a verdict
    sec = labelfree_section(out, tmp_path)
    first = sec.blocks[0]
    assert isinstance(first, Paragraph) and first.text.startswith("Verdict without labels: none")
    says(first.text, "random init", "other monitor params", "older", "pretrain verdict: none")
    # no label-free numbers at all: the section names both params that turn the monitor off
    pre = read_json(tmp_path / "run/eval/metrics/pretrain.json")
    write_json(tmp_path / "run/eval/metrics/pretrain.json",
               {k: v for k, v in pre.items() if k != "rankme"})
    sec = labelfree_section(read_outputs(tmp_path / "run", "data/shards"), tmp_path)
    says(sec.blocks[0].text, NOT_AVAILABLE, "pretrain.knn_every_epochs", "labelfree_images")


def test_label_efficiency__points_read_in_increasing_n_not_as_sorted_text(tmp_path):
    # write_json sorts keys as text ("1", "10", "100", "2", "25", "5"): the curve, its figure
    # and its table must still run 1, 2, 5, 10, 25, 100.
    root = make_run(tmp_path / "run")
    ns = [1, 2, 5, 10, 25, 100]
    point = {"mean": 50.0, "std": 1.0, "min": 49.0, "max": 51.0}
    curve = {kind: {probe: {str(n): dict(point) for n in ns} for probe in ("knn", "linear")}
             for kind in ("moco", "raw_pixels", "random_encoder")}
    write_json(root / "eval/metrics/label_efficiency.json",
               {"draws": 2, "train_images": 60, "curve": curve})
    assert '"10"' in (root / "eval/metrics/label_efficiency.json").read_text().split('"2"')[0]
    out = read_outputs(root, "data/shards")
    assert list(out.label_efficiency["curve"]["moco"]["knn"]) == [str(n) for n in ns]
    figs = tmp_path / "figs"
    figs.mkdir()
    table = next(b for b in label_efficiency_section(out, figs).blocks if isinstance(b, Table))
    assert table.headers[2:] == [f"{n}/class" for n in ns]


def test_label_efficiency__a_point_a_class_could_not_fill_says_what_it_used(tmp_path):
    # 60 train images of 2 classes: 1/class and 10/class fill; at 25/class the smaller class
    # (20 images) gives 20, the point uses 45 labels: the header and a sentence say so
    root = make_run(tmp_path / "run")
    curve = copy.deepcopy(LABEL_EFFICIENCY["curve"])
    for probes in curve.values():
        for points in probes.values():
            points["1"].update(labels=2, per_class_min=1)
            points["10"].update(labels=20, per_class_min=10)
            points["25"] = {**points["10"], "labels": 45, "per_class_min": 20}
    write_json(root / "eval/metrics/label_efficiency.json",
               {"draws": 3, "train_images": 60, "curve": curve})
    figs = tmp_path / "figs"
    figs.mkdir()
    sec = label_efficiency_section(read_outputs(root, "data/shards"), figs)
    table = next(b for b in sec.blocks if isinstance(b, Table))
    assert table.headers[2:] == ["1/class", "10/class", "25/class (≥ 20)"]
    texts = [b.text for b in sec.blocks if isinstance(b, Paragraph)]
    assert "at 25/class the smallest class gives 20, 45 labels in all" in texts[0]


def test_label_efficiency__no_stars_where_the_images_per_class_are_unknown(tmp_path):
    # stars sit at train images / classes: without class names that x is not known
    root = make_run(tmp_path / "run")
    figs = tmp_path / "figs"
    figs.mkdir()
    out = read_outputs(root, "data/shards")
    caption = label_efficiency_section(out, figs).blocks[0].caption
    assert "Stars, side by side at the train images per class" in caption
    assert "MoCo k=20, T=0.1, raw pixels k=5, T=0.05 chosen on held-out" in caption  # KNN, BASE
    (root / "data/shards/test/manifest.json").unlink()
    for stem in ("knn", "linear"):
        (root / f"eval/{stem}_details.json").unlink()
    caption = label_efficiency_section(read_outputs(root, "data/shards"), figs).blocks[0].caption
    assert caption.endswith("No stars: the train images per class are not available "
                            "(no class names).")
