"""The encoder's MLflow path against a real tracking server, and the UI in headless Chromium.

One ``mlflow server`` on 127.0.0.1 (its own SQLite database and artifact folder, under tmp) for
the module. The stages' functions log to it over HTTP: two pretrainings published, scored by
the linear probe. Then a fresh process loads ``models:/moco-encoder@champion`` through the
server, and Debian's ``chromium --headless --dump-dom`` renders the URL that ``make ui`` prints
(the runs table) and the experiment's Models view (skipped without chromium; ``.ci/run``
installs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from registryhelpers import PARAMS, other_bytes, publish, score, train_tiny

from pipeline.config import from_dict
from pipeline.tracking import stage_run, ui_url
from pipeline.tracking.ui import TABLE_LEADING_COLUMNS, headline_view_state

pytestmark = pytest.mark.slow  # the server alone takes ~15 s to start on 2 cores

REPO = Path(__file__).resolve().parents[1]
NAME = "moco-encoder"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(uri, workdir, records)``: a running server holding two published, scored versions."""
    root = tmp_path_factory.mktemp("server")
    port = free_port()
    mlflow_cli = str(Path(sys.executable).parent / "mlflow")
    proc = subprocess.Popen(
        [mlflow_cli, "server", "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        cwd=root, stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "w"),
        start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            try:
                with urllib.request.urlopen(uri + "/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
                assert time.time() - t0 < 120, "mlflow server did not come up in 120 s"
                time.sleep(0.5)
        wd = train_tiny(root / "wd")
        mp = pytest.MonkeyPatch()
        mp.chdir(wd)
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("DVC_EXP_NAME", "exp-srv")
        try:
            records = [publish()]
            score("knn", 61.0)
            score("linear", 80.0)
            other_bytes()
            records.append(publish())
            score("linear", 85.0)
            report_run({"knn.json": {"top1": 61.0}, "linear.json": {"top1": 85.0},
                        "baselines.json": {"pixels_knn": 52.5}})
        finally:
            mp.undo()
            mlflow.set_tracking_uri(None)
        yield uri, wd, records
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn worker
        proc.wait(timeout=60)


def report_run(metrics: dict[str, dict]) -> None:
    """What the report stage logs, from these metrics files: every headline number."""
    for name, values in metrics.items():
        Path("metrics").mkdir(exist_ok=True)
        Path("metrics", name).write_text(json.dumps(values))
    with stage_run("report", from_dict(PARAMS)):
        pass


LOAD = """
import sys, torch, mlflow
model = mlflow.pytorch.load_model(sys.argv[1])
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])), sys.argv[3])
"""


def test_server__versions_aliases_and_champion_loads_in_a_fresh_process(server, tmp_path):
    uri, wd, records = server
    client = MlflowClient(uri)
    assert [r["model_version"] for r in records] == ["1", "2"]
    aliases = client.get_registered_model(NAME).aliases
    assert {k: int(v) for k, v in aliases.items()} == {"champion": 2, "newest": 2}  # 85 > 80
    v1 = client.get_model_version(NAME, "1")
    assert v1.tags["linear.top1"] == "80" and v1.tags["knn.top1"] == "61"
    assert v1.tags["dvc.exp_name"] == "exp-srv"
    for r in records:  # the artifacts went to the server's store, not into the workdir
        assert client.get_run(r["run_id"]).info.status == "FINISHED"
    assert not (wd / "mlartifacts").exists()

    from pipeline.evaluate.run.embed import load_encoder

    x = torch.randn(10, 1, 16, 16)
    torch.save(x, tmp_path / "x.pt")
    out = subprocess.run([sys.executable, "-c", LOAD, f"models:/{NAME}@champion",
                          str(tmp_path / "x.pt"), str(tmp_path / "y.pt")],
                         env={**os.environ, "MLFLOW_TRACKING_URI": uri}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    eager, _ = load_encoder(wd / "models/encoder.pt", pool_grid=1)
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "y.pt"), eager.eval()(x))


CHROMIUM = shutil.which("chromium")


def text(html: str) -> str:
    """The visible text of a DOM dump, whitespace collapsed."""
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def dump_dom(url: str, profile: Path) -> str:
    """The DOM after the page's scripts ran (virtual time), as Debian's chromium renders it."""
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={profile}", "--window-size=4000,1200",
         "--virtual-time-budget=30000", "--dump-dom", url],
        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_ui__runs_table_and_models_view_in_headless_chromium(server, tmp_path):
    uri, _, records = server
    eid = records[0]["experiment_id"]
    # the URL `make ui` prints and the report links: the model-training view's runs table in
    # the saved view of the headline numbers: the report run's row, the top1.* columns
    view = dump_dom(ui_url(uri, eid), tmp_path / "view-profile")
    assert 'col-id="attributes.`Run Name`"' in view  # the runs table itself
    columns = re.findall(r'col-id="metrics\.`([^`]+)`"', view)  # the header, then each row
    assert list(dict.fromkeys(columns)) == ["top1.knn", "top1.knn.pixels", "top1.linear"]
    # after the table's own leading columns, each header as wide as the view asks
    index = {}
    for cell in re.findall(r'<div[^>]*role="columnheader"[^>]*>', view):
        col, at = re.search(r'col-id="([^"]+)"', cell), re.search(r'aria-colindex="(\d+)"', cell)
        if col and at:
            index[col.group(1)] = int(at.group(1))
    assert [index[c] for c in TABLE_LEADING_COLUMNS] == [2, 3, 4]  # after the checkbox
    assert index["metrics.`top1.knn`"] == 5
    widths = {col: int(w) for col, w in re.findall(
        r'role="columnheader"[^>]*col-id="metrics\.`([^`]+)`"[^>]*width: (\d+)px', view)}
    assert widths == {name: headline_view_state()["columnWidths"][f"metrics.`{name}`"]
                      for name in ("top1.knn", "top1.knn.pixels", "top1.linear")}
    assert "exp-srv:report" in view and "exp-srv:pretrain" not in view  # one row per pipeline run
    assert "52.5" in text(view) and "85" in text(view).split()

    runs = dump_dom(ui_url(uri, eid, view=None), tmp_path / "profile")  # the plain table
    for name in ("exp-srv:pretrain", "exp-srv:knn", "exp-srv:linear"):
        assert name in runs, f"run {name} missing from the runs table"
    # the Models column of the pretrain runs: their registered versions
    assert {f"{NAME} v1", f"{NAME} v2"} <= set(re.findall(rf"{NAME} v\d+", text(runs)))
    # without the URL parameter a fresh browser lands elsewhere (GenAI view): no runs table
    plain = dump_dom(f"{uri}/#/experiments/{eid}", tmp_path / "fresh-profile")
    assert 'col-id="attributes.`Run Name`"' not in plain

    models = dump_dom(f"{uri}/#/experiments/{eid}/models?workflowType=machine_learning",
                      tmp_path / "profile")
    for r in records:
        assert r["model_id"] in models, "a logged model is missing from the Models view"
    assert ">encoder<" in models
    assert "top1.linear" in models and "top1.knn" in models  # the attached scores' columns
    assert f"{NAME}/versions/2" in models  # the registered version beside the model
