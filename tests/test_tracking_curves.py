"""Curves as run artifacts (pipeline/tracking/curves.py): the table and a matplotlib figure of
it, in the run of the stage that made them."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from pipeline.config import from_dict
from pipeline.tracking import stage_run
from pipeline.tracking.curves import (
    STAGE_CURVES,
    Curve,
    draw_curve,
    label_efficiency_table,
)

REPO = Path(__file__).resolve().parents[1]


def test_label_efficiency_table__committed_curve__numeric_rows_means_and_stds():
    # the default run's whole curve, as its label_efficiency stage wrote it (results/)
    run = REPO / "results/fashion-mnist-default-2026-12-06-epyc-bf16"
    curve = json.loads((run / "metrics/label_efficiency.json").read_text())["curve"]
    columns, rows = label_efficiency_table(curve)
    counts = sorted(int(n) for n in curve["moco"]["knn"])  # "1", "10", "100", "2", ... as ints
    assert [r["labels_per_class"] for r in rows] == counts == [1, 2, 5, 10, 25, 100]
    assert columns[0] == "labels_per_class"
    assert {"moco_knn", "moco_knn_std", "moco_linear", "raw_pixels_knn"} <= set(columns)
    ten = rows[counts.index(10)]
    assert ten["moco_knn"] == curve["moco"]["knn"]["10"]["mean"]
    assert ten["moco_linear_std"] == curve["moco"]["linear"]["10"]["std"]


def _lines(fig) -> list[list[str]]:
    return [[ln.get_label() for ln in ax.get_lines()] for ax in fig.axes]


def test_draw_curve__empty_column_not_drawn_std_as_band_log_x():
    table = pd.read_csv(io.StringIO("epoch\tloss\ttrain_acc\tval_acc\n1\t2.0\t50\t\n"
                                    "2\t1.5\t60\t\n"), sep="\t")
    fig = draw_curve(table, Curve("t", "t.tsv", "T", "epoch",
                                  (("loss", ("loss",)), ("acc", ("train_acc", "val_acc")),
                                   ("absent", ("nope",)))))
    # val_acc has no number: not drawn as a 0 % line; a column the table lacks is skipped
    assert _lines(fig) == [["loss"], ["train_acc"], []]
    assert fig.axes[2].texts[0].get_text() == "no values"
    np.testing.assert_array_equal(fig.axes[0].get_lines()[0].get_ydata(), [2.0, 1.5])

    banded = pd.DataFrame({"n": [1, 10], "a": [50.0, 70.0], "a_std": [2.0, 1.0]})
    fig = draw_curve(banded, Curve("b", "b.tsv", "B", "n", (("top-1", ("a",)),), log_x=True))
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and len(ax.collections) == 1  # the mean +- std band
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert band.min() == pytest.approx(48.0) and band.max() == pytest.approx(71.0)



def _artifacts(run_id: str, tmp: Path) -> dict[str, bytes]:
    local = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="curves",
                                                     dst_path=str(tmp)))
    return {p.name: p.read_bytes() for p in sorted(local.iterdir())}


def test_stage_run__pretrain_and_label_efficiency_log_table_and_figure(db, tmp_path):
    whole = REPO / "results/fashion-mnist-default-2026-12-06-epyc-bf16/metrics"
    for rel, src in (("plots/knn_monitor.tsv", REPO / "plots/knn_monitor.tsv"),
                     ("plots/labelfree.tsv", REPO / "plots/labelfree.tsv"),
                     ("eval/metrics/label_efficiency.json", whole / "label_efficiency.json")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, tmp_path / rel)
    p = from_dict({"mlflow": {"experiment": "c"}})
    got = {}
    for stage in ("pretrain", "label_efficiency", "knn"):
        with stage_run(stage, p):
            pass
        run_id = json.loads((tmp_path / f"runs/{stage}.json").read_text())["run_id"]
        names = [a.path for a in MlflowClient(db).list_artifacts(run_id, "curves")]
        got[stage] = _artifacts(run_id, tmp_path / stage) if names else {}
    assert sorted(got["pretrain"]) == ["knn_monitor.png", "knn_monitor.tsv", "labelfree.png",
                                       "labelfree.tsv"]
    assert got["pretrain"]["labelfree.tsv"] == (REPO / "plots/labelfree.tsv").read_bytes()
    assert all(got[s][f].startswith(b"\x89PNG") for s in got for f in got[s] if f.endswith("png"))
    assert sorted(got["label_efficiency"]) == ["label_efficiency.png", "label_efficiency.tsv"]
    table = pd.read_csv(io.BytesIO(got["label_efficiency"]["label_efficiency.tsv"]), sep="\t")
    curve = json.loads((whole / "label_efficiency.json").read_text())["curve"]
    assert table["labels_per_class"].tolist() == [1, 2, 5, 10, 25, 100]
    assert table.loc[table.labels_per_class == 100, "raw_pixels_linear"].item() == pytest.approx(
        curve["raw_pixels"]["linear"]["100"]["mean"])
    assert got["knn"] == {}  # a stage without curves logs none
    assert set(STAGE_CURVES) == {"pretrain", "label_efficiency"}


def test_stage_run__header_only_table__no_curve_logged(db, tmp_path):
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots/knn_monitor.tsv").write_text("epoch\tstep\tknn_top1\tknn_top5\n")
    with stage_run("pretrain", from_dict({})):
        pass
    run_id = json.loads((tmp_path / "runs/pretrain.json").read_text())["run_id"]
    assert MlflowClient(db).list_artifacts(run_id, "curves") == []
