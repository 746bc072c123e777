"""The report's "Which images to label" section, from planted select_labels outputs."""

import json

from pipeline.report.document import FigureRef, Paragraph, Table
from pipeline.report.selection import selection_section


def _point(knn: float, linear: float, classes: float, spread: float = 0.0) -> dict:
    def s(v: float) -> dict:
        return {"mean": v, "min": v - spread, "max": v + spread, "std": spread / 2}
    return {"knn": s(knn), "linear": s(linear), "classes": s(classes)}


def _write(root, measured, skipped=None) -> None:
    (root / "eval/metrics").mkdir(parents=True)
    # the keys as the stage's JSON writer leaves them: sorted as text ("10", "100", "20")
    (root / "eval/metrics/selection.json").write_text(json.dumps(
        {"draws": 5, "measured": measured, "skipped": skipped}, sort_keys=True))
    picks = {"typical": {str(b): [{"order": 1, "key": f"k{b}", "shard": "nowhere.tar",
                                   "cluster": 0}] for b in (10, 20, 100)}}
    (root / "eval/selection.json").write_text(json.dumps(
        {"budgets": [10, 20, 100], "images": 500, "excluded_outliers": 5, "picks": picks},
        sort_keys=True))


def test_selection_section__budgets_in_numeric_order_and_the_gain_over_random(tmp_path):
    measured = {"random": {"10": _point(40.0, 30.0, 6.0, 5.0), "20": _point(50.0, 45.0, 8.0, 4.0),
                           "100": _point(70.0, 72.0, 10.0, 2.0)},
                "typical": {"10": _point(56.0, 47.5, 9.0), "20": _point(60.0, 44.0, 9.0),
                            "100": _point(71.0, 71.0, 10.0)}}
    _write(tmp_path, measured)
    sec = selection_section(tmp_path, "typical", 1, tmp_path / "fig")
    table = next(b for b in sec.blocks if isinstance(b, Table))
    assert table.headers == ["picked by", "probe", "10 labels", "20 labels", "100 labels"]
    # random, the baseline, first
    assert table.rows[0] == ["random", "knn", "40.00 ± 2.50", "50.00 ± 2.00", "70.00 ± 1.00"]
    text = " ".join(b.text for b in sec.blocks if isinstance(b, Paragraph))
    # gains: 10 labels kNN 56 - 40 = +16, linear 47.5 - 30 = +17.5; 20 labels kNN +10, linear
    # 44 - 45 = -1: three of the four comparisons at 5 points or more, named
    assert ("A method beats random by at least 5 points at 10 labels kNN, 10 labels linear "
            "probe, 20 labels kNN (of 4 comparisons at the two smallest budgets)") in text
    assert "10 labels, kNN: TypiClust (typical) 56.00 % (9 classes) against random 40.00 %" in text
    assert "+16.00 points" in text and "-1.00 points" in text
    assert [b.name for b in sec.blocks if isinstance(b, FigureRef)] == ["selection.png",
                                                                         "selection_picks.png"]
    assert "at a budget of 100" not in " ".join(b.caption for b in sec.blocks
                                                 if isinstance(b, FigureRef))


def test_selection_section__no_method_ahead_said_plainly(tmp_path):
    measured = {"random": {"10": _point(40.0, 30.0, 6.0), "20": _point(50.0, 45.0, 8.0)},
                "kcenter": {"10": _point(39.0, 29.0, 7.0), "20": _point(49.0, 44.0, 9.0)}}
    _write(tmp_path, measured)
    text = " ".join(b.text for b in selection_section(tmp_path, "typical", 0, tmp_path).blocks
                    if isinstance(b, Paragraph))
    assert "No method beats random at the smallest budgets" in text


def test_selection_section__not_measured_says_why(tmp_path):
    _write(tmp_path, None, skipped="no labelled train or test images (data.source none)")
    sec = selection_section(tmp_path, "typical", 0, tmp_path)
    text = " ".join(b.text for b in sec.blocks if isinstance(b, Paragraph))
    assert "Not measured: no labelled train or test images (data.source none)" in text
    assert not [b for b in sec.blocks if isinstance(b, Table)]
