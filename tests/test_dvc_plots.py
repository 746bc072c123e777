"""`dvc plots show` on the committed curves: every column of every plots/*.tsv drawn once, no
empty column, and a page that draws them with no network (issue 54, item 3).

Expected curves come from the TSV headers themselves (every column but the x axes `step`,
`epoch` and `per_class`, and the label-efficiency rows' keys `features` and `probe`), not from
dvc.yaml: a column added to a TSV and not declared fails here.
"""

import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLOT_FILES = ("plots/pretrain.tsv", "plots/knn_monitor.tsv", "plots/labelfree.tsv",
              "plots/linear.tsv", "plots/linear_val.tsv", "plots/label_efficiency.tsv",
              "plots/selection.tsv")
X_AXES = {"step", "epoch", "per_class", "budget"}
# plots/label_efficiency.tsv: one row per (n, features, probe), and the labels that point used
# in all (a count, not a curve); plots/selection.tsv: one per (budget, method, probe), and the
# classes the picks reached (a count shown in the report's table)
ROW_KEYS = {"features", "probe", "labels", "method", "classes"}
VENDOR = ROOT / "vendor/vega"
CHROMIUM = shutil.which("chromium")


def dvc_copy(tmp_path: Path) -> tuple[str, dict]:
    """A copy holding dvc.yaml, params.yaml, the curves and .dvc/'s config and templates."""
    for f in ("dvc.yaml", "params.yaml", *PLOT_FILES):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    dvc = str(Path(sys.executable).parent / "dvc")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    subprocess.run([dvc, "init", "--no-scm", "-q"], cwd=tmp_path, env=env, check=True)
    shutil.copy(ROOT / ".dvc/config", tmp_path / ".dvc/config")
    shutil.copytree(ROOT / ".dvc/plots", tmp_path / ".dvc/plots")
    shutil.copytree(VENDOR, tmp_path / "vendor/vega")
    return dvc, env


def dvc_plots_json(tmp_path: Path) -> dict:
    """`dvc plots show --json` in a copy (:func:`dvc_copy`)."""
    dvc, env = dvc_copy(tmp_path)
    out = subprocess.run([dvc, "plots", "show", "--json"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["data"]


def fields(spec: dict | list, key: str) -> set[str]:
    """Every ``field`` of an encoding channel ``key`` anywhere in a vega-lite spec."""
    found = set()
    if isinstance(spec, dict):
        enc = spec.get("encoding", {})
        if isinstance(enc.get(key), dict) and "field" in enc[key]:
            found.add(enc[key]["field"])
        for v in spec.values():
            found |= fields(v, key)
    elif isinstance(spec, list):
        for v in spec:
            found |= fields(v, key)
    return found


def drawn_curves(plot: dict) -> tuple[str, set[str], set[str], set[str]]:
    """(title, x fields, y columns, columns of the source rows) of one rendered vega plot."""
    content = plot["content"]
    values = content["data"]["values"]
    dvc_added = {"rev", "field", "filename", "dvc_inferred_y_value", "step_index"}
    columns = set(values[0]) - dvc_added
    ys = {v["field"] for v in values if "field" in v}  # several y of one file: a `field` per row
    ys |= (fields(content, "y") | fields(content, "y2")) - {"dvc_inferred_y_value"}
    return content["title"]["text"], fields(content, "x"), ys, columns


def rows(f: str) -> list[dict[str, str]]:
    with open(ROOT / f) as fh:
        return list(csv.DictReader(fh, delimiter="\t"))


def header(f: str) -> list[str]:
    with open(ROOT / f) as fh:
        return next(csv.reader(fh, delimiter="\t"))


def test_curve_files__no_empty_cell_no_column_without_a_value():
    # `dvc plots show` draws an empty cell at 0 (a value not measured is written NaN, which it
    # leaves out) and a column of NaN as a legend entry without a line: neither is written
    # (plots/linear_val.tsv has a header and no rows without a validation split: not drawn)
    for f in PLOT_FILES:
        table = rows(f)
        assert all(v != "" for r in table for v in r.values()), f"{f}: an empty cell"
        for col in header(f):
            assert not table or any(r[col] != "NaN" for r in table), f"{f}: {col} has no value"


def test_dvc_plots_show__every_column_of_every_curve_file_drawn_once(tmp_path):
    expected = {(f, col) for f in PLOT_FILES for col in header(f)
                if col not in X_AXES | ROW_KEYS and rows(f)}
    # 8 pretraining, 2 kNN-monitor, 4 label-free, 4 linear-probe (no validation split in the
    # committed run), 3 label-efficiency (mean, min, max of the draws), 3 selection (the same)
    assert len(expected) == 24

    data = dvc_plots_json(tmp_path)
    assert data.pop("plots/linear_val.tsv") == []  # no rows: no plot
    drawn: list[tuple[str, str]] = []
    for plot_id, renders in data.items():
        (plot,) = renders  # one revision: the workspace
        title, xs, ys, columns = drawn_curves(plot)
        (source,) = [f for f in PLOT_FILES if set(header(f)) == columns]  # the rows' file
        assert title and len(xs) == 1 and xs <= X_AXES & columns, plot_id
        drawn += [(source, y) for y in ys]
    assert len(data) == 18  # 6 stage-level plots (one y each) + 12 top-level definitions
    assert sorted(drawn) == sorted(expected)  # every column drawn, and exactly once


def test_dvc_plots_show__label_efficiency_one_plot_per_probe_one_line_per_features(tmp_path):
    (plot,) = dvc_plots_json(tmp_path)["plots/label_efficiency.tsv"]
    content = plot["content"]
    assert content["facet"]["column"]["field"] == "probe"
    assert fields(content, "color") == {"features"}
    assert content["spec"]["encoding"]["x"]["scale"]["type"] == "log"
    table = rows("plots/label_efficiency.tsv")
    assert {(r["features"], r["probe"]) for r in table} == {
        (f, p) for f in ("moco", "raw_pixels", "random_encoder") for p in ("knn", "linear")}
    assert [int(r["per_class"]) for r in table] == sorted(int(r["per_class"]) for r in table)


class _Page(HTMLParser):
    """The inline scripts of a page and every attribute that could fetch something."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []
        self.links: list[tuple[str, str, str]] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.links += [(tag, k, v or "") for k, v in attrs if k in ("src", "href", "srcset")]
        if tag == "script":
            self._in_script = True
            self.scripts.append("")

    def handle_endtag(self, tag: str) -> None:
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts[-1] += data


def test_offline_page__the_three_libraries_as_npm_ships_them_licences_beside():
    page = _Page()
    page.feed((VENDOR / "page.html").read_text())
    sources = json.loads((VENDOR / "sources.json").read_text())
    assert [s["package"] for s in sources] == ["vega", "vega-lite", "vega-embed"]
    digests = [hashlib.sha256(s.encode()).hexdigest() for s in page.scripts]
    for s in sources:
        assert s["sha256"] in digests, s["package"]  # byte for byte the npm package's file
        licence = (VENDOR / f"LICENSE-{s['package']}").read_text()
        assert "Redistribution and use in source and binary forms" in licence
    assert page.links == []  # nothing loaded from anywhere, not even a file beside it
    text = (VENDOR / "page.html").read_text()
    # DVC fills {plot_divs}; without {scripts} it adds none of its CDN <script src=...> tags
    assert "{plot_divs}" in text and "{scripts}" not in text


def test_dvc_plots_show__page_references_no_url_and_holds_every_plot(tmp_path):
    dvc, env = dvc_copy(tmp_path)
    out = subprocess.run([dvc, "plots", "show", "-o", "shown"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    html = (tmp_path / "shown/index.html").read_text()
    page = _Page()
    page.feed(html)
    assert page.links == [], page.links  # DVC's own page: three <script src="https://cdn...">
    assert "cdn.jsdelivr" not in html
    ids = re.findall(r"vegaEmbed\('#([^']+)'", html)
    assert len(ids) == 19  # the 18 plots of --json, and plots/linear_val.tsv with an empty spec


def rendered(page: Path, profile: Path) -> str:
    """The DOM of ``page`` after its scripts ran, in headless chromium with no way out: every
    host name resolves nowhere and every connection goes to a closed local port."""
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND",
         "--proxy-server=127.0.0.1:9", "--window-size=1500,7000",
         "--virtual-time-budget=20000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_dvc_plots_show__drawn_in_headless_chromium_without_network(tmp_path):
    dvc, env = dvc_copy(tmp_path)
    subprocess.run([dvc, "plots", "show", "-o", "shown"], cwd=tmp_path, env=env, check=True,
                   capture_output=True, timeout=300)
    dom = rendered(tmp_path / "shown/index.html", tmp_path / "profile")
    # vega-embed marks each container it drew in and puts the chart's canvas inside it
    drawn = re.findall(r'<div id="([^"]+)" class="vega-embed[^"]*"[^>]*>.*?<canvas', dom, re.S)
    assert len(drawn) == 18 and "plots_selection_tsv" in drawn, drawn
    assert re.search(r'<div id="plots_linear_val_tsv" style="display: none;">', dom)
