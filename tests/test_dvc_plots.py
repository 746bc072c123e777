"""`dvc plots show --json` on the committed curves draws every column of every plots/*.tsv.

Expected curves come from the TSV headers themselves (every column but the x axes `step` and
`epoch`), not from dvc.yaml: a column added to a TSV and not declared fails here.
"""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLOT_FILES = ("plots/pretrain.tsv", "plots/knn_monitor.tsv", "plots/labelfree.tsv",
              "plots/linear.tsv")
X_AXES = {"step", "epoch"}


def dvc_plots_json(tmp_path: Path) -> dict:
    """`dvc plots show --json` in a copy holding dvc.yaml, params.yaml and the curves."""
    for f in ("dvc.yaml", "params.yaml", *PLOT_FILES):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    dvc = str(Path(sys.executable).parent / "dvc")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    subprocess.run([dvc, "init", "--no-scm", "-q"], cwd=tmp_path, env=env, check=True)
    out = subprocess.run([dvc, "plots", "show", "--json"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["data"]


def drawn_curves(plot: dict) -> tuple[str, str, set[str], set[str]]:
    """(title, x field, y columns, columns of the source rows) of one rendered vega plot."""
    content = plot["content"]
    values = content["data"]["values"]
    fields = {v["field"] for v in values if "field" in v}  # several y: one `field` per row
    ys = fields or {content["layer"][0]["encoding"]["y"]["field"]}
    dvc_added = {"rev", "field", "filename", "dvc_inferred_y_value", "step_index"}
    columns = set(values[0]) - dvc_added
    return content["title"]["text"], content["encoding"]["x"]["field"], ys, columns


def header(f: str) -> list[str]:
    with open(ROOT / f) as fh:
        return next(csv.reader(fh, delimiter="\t"))


def test_dvc_plots_show__every_column_of_every_curve_file_drawn_once(tmp_path):
    expected = {(f, col) for f in PLOT_FILES for col in header(f) if col not in X_AXES}
    # 8 pretraining, 2 kNN-monitor, 3 label-free (RankMe, alignment, uniformity), 5 linear-probe
    assert len(expected) == 18

    data = dvc_plots_json(tmp_path)
    drawn: list[tuple[str, str]] = []
    for plot_id, renders in data.items():
        (plot,) = renders  # one revision: the workspace
        title, x, ys, columns = drawn_curves(plot)
        (source,) = [f for f in PLOT_FILES if set(header(f)) == columns]  # the rows' file
        assert title and x in X_AXES and x in columns, plot_id
        drawn += [(source, y) for y in ys]
    assert len(data) == 15  # 4 stage-level plots (one y each) + 11 top-level definitions
    assert sorted(drawn) == sorted(expected)  # every column drawn, and exactly once
