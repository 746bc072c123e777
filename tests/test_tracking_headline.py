"""The headline numbers (pipeline/tracking/headline.py): names that sort together, values read
from the metrics files, the lines the report stage ends ``dvc repro`` with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mlflow.tracking import MlflowClient

from pipeline.config import from_dict
from pipeline.tracking import stage_run
from pipeline.tracking.headline import (
    HEADLINES,
    headline_from,
    headline_metrics,
    stage_headline,
    summary_lines,
)

REPO = Path(__file__).resolve().parents[1]


def committed(name: str) -> dict:
    return json.loads((REPO / "metrics" / name).read_text())


def test_headlines__one_prefix_sorted_probe_first_each_in_its_stage_file():
    names = [h.name for h in HEADLINES]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert all(n.startswith("top1.knn") or n.startswith("top1.linear") for n in names)
    # every probe's own number comes first, then its baselines (the console's order)
    assert [n for n in names if n.count(".") == 1] == ["top1.knn", "top1.linear"]
    assert {h.file for h in HEADLINES} == {"metrics/knn.json", "metrics/linear.json",
                                           "metrics/baselines.json",
                                           "metrics/label_efficiency.json"}


def test_headline_metrics__committed_files__every_name_its_value():
    # the values as the committed metrics files hold them, looked up by hand
    knn, linear = committed("knn.json"), committed("linear.json")
    base, labels = committed("baselines.json"), committed("label_efficiency.json")
    want = {
        "top1.knn": knn["top1"],
        "top1.knn.labels_1": labels["knn"]["1"],
        "top1.knn.labels_10": labels["knn"]["10"],
        "top1.knn.pixels": base["pixels_knn"],
        "top1.knn.random": base["random_knn"],
        "top1.linear": linear["top1"],
        "top1.linear.labels_1": labels["linear"]["1"],
        "top1.linear.labels_10": labels["linear"]["10"],
        "top1.linear.pixels": base["pixels_linear"],
    }
    assert headline_metrics(root=REPO) == want
    assert list(headline_metrics(root=REPO)) == sorted(want)
    assert headline_metrics("metrics/knn.json", root=REPO) == {"top1.knn": knn["top1"]}
    assert stage_headline("embed", REPO) == {}  # measures none
    assert stage_headline("report", REPO) == want  # its run: one row with every number


def test_headline_from__missing_or_not_a_number__left_out_never_zero():
    assert headline_from("metrics/baselines.json", {"pixels_knn": 80.5, "k": 200,
                                                    "random_knn": True}) == {
        "top1.knn.pixels": 80.5}
    assert headline_from("metrics/knn.json", None) == {}
    assert headline_from("metrics/label_efficiency.json", {"knn": {"5": 60.0}}) == {}


def test_summary_lines__probe_beside_its_baselines_few_labels_report_and_mlflow():
    values = {"top1.knn": 87.01, "top1.knn.pixels": 81.78, "top1.knn.random": 78.36,
              "top1.linear": 90.37, "top1.knn.labels_1": 54.11, "top1.linear.labels_10": 71.5}
    assert summary_lines(values, report="reports/report.html", runs_url="http://h/#/x") == [
        "kNN top-1 87.01 % (raw pixels 81.78 %, random encoder 78.36 %)",
        "linear top-1 90.37 %",
        "from 1, 10 labelled images per class: kNN 54.11 %, -; linear -, 71.50 %",
        "report: reports/report.html",
        "MLflow: http://h/#/x",
    ]
    # no labels (data.source none): no probe line, the report is still named
    assert summary_lines({}, report="reports/report.html") == ["report: reports/report.html"]


def test_summary_lines__docs_example_is_what_the_committed_metrics_print():
    doc = (REPO / "docs/tracking.md").read_text()
    block = doc.split("`dvc repro` ends with them")[1].split("```text\n")[1].split("```")[0]
    shown = block.splitlines()
    printed = summary_lines(headline_metrics(root=REPO), report="reports/report.html")
    assert shown[:len(printed)] == printed and shown[len(printed)].startswith("MLflow: ")



def test_stage_run__baselines_and_report_runs_hold_their_headline_metrics(db, tmp_path):
    shutil.copytree(REPO / "metrics", tmp_path / "metrics")
    p = from_dict({"mlflow": {"experiment": "h"}})
    with stage_run("baselines", p):
        pass
    with stage_run("embed", p):
        pass
    with stage_run("report", p):
        pass
    c = MlflowClient(db)
    got = {}
    for stage in ("baselines", "embed", "report"):
        run_id = json.loads((tmp_path / f"runs/{stage}.json").read_text())["run_id"]
        got[stage] = c.get_run(run_id).data.metrics
    base = committed("baselines.json")
    assert got["baselines"] == {"top1.knn.pixels": base["pixels_knn"],
                                "top1.knn.random": base["random_knn"],
                                "top1.linear.pixels": base["pixels_linear"]}
    assert got["embed"] == {}
    assert got["report"]["top1.knn"] == committed("knn.json")["top1"]
    assert got["report"]["top1.linear"] == committed("linear.json")["top1"]
    assert len(got["report"]) == len(HEADLINES)
