import json
import os
import signal
import subprocess
import sys
import time

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from pipeline.config import from_dict
from pipeline.tracking import (
    TrackingError,
    check_reachable,
    loggable_params,
    stage_run,
    tracking_uri,
)


@pytest.fixture()
def db(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    yield uri
    mlflow.set_tracking_uri(None)


def test_tracking_uri__env_then_dvc_root(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    assert tracking_uri() == "http://127.0.0.1:1"


def test_loggable_params__dotted_names_and_strings():
    flat = loggable_params(from_dict({"moco": {"K": 1024}}))
    assert flat["moco.K"] == "1024" and flat["pretrain.lr_milestones"] == "[120, 160]"
    assert not any(k.startswith("MLFLOW") or "PATH" in k for k in flat)  # no environment dump


def test_stage_run__lineage_tags_and_run_json(db, tmp_path, monkeypatch):
    monkeypatch.setenv("DVC_EXP_NAME", "exp-x")
    p = from_dict({"mlflow": {"experiment": "t"}})
    with stage_run("pretrain", p) as r:
        r.log_metrics({"loss": 1.5}, step=3)
    up = json.loads((tmp_path / "runs/pretrain.json").read_text())
    with stage_run("knn", p, upstream=("pretrain", "embed")):
        pass
    down = json.loads((tmp_path / "runs/knn.json").read_text())
    c = MlflowClient(db)
    run = c.get_run(down["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["stage"] == "knn"
    assert run.data.tags["upstream.pretrain"] == up["run_id"]
    assert run.data.tags["upstream.embed"] == "unknown"  # no runs/embed.json
    assert run.data.tags["dvc.exp_name"] == "exp-x"
    assert "git.commit" in run.data.tags and "git.dirty" in run.data.tags
    assert run.data.params["moco.K"] == "4096"
    first = c.get_run(up["run_id"])
    assert c.get_metric_history(first.info.run_id, "loss")[0].step == 3


def test_stage_run__exception_marks_failed(db, tmp_path):
    p = from_dict({})
    with pytest.raises(ZeroDivisionError), stage_run("embed", p):
        1 / 0  # noqa: B018
    runs = MlflowClient(db).search_runs([MlflowClient(db).get_experiment_by_name(
        p.mlflow.experiment).experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    assert not (tmp_path / "runs/embed.json").exists()


def test_stage_run__disabled_logs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # would fail if contacted
    with stage_run("knn", from_dict({"mlflow": {"enabled": False}})) as r:
        r.log_metrics({"a": 1.0})
        assert not r.active
    assert json.loads((tmp_path / "runs/knn.json").read_text())["run_id"] is None
    assert not (tmp_path / "mlflow.db").exists()


def test_check_reachable__unreachable_server_fails_fast():
    t0 = time.time()
    with pytest.raises(TrackingError, match="unreachable"):
        check_reachable("http://127.0.0.1:9", timeout_s=2)
    assert time.time() - t0 < 10


def test_stage_run__unreachable_server_before_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    entered = []
    with pytest.raises(TrackingError), stage_run("pretrain", from_dict({})):
        entered.append(1)
    assert entered == []


SCRIPT = """
import sys, time
from pipeline.config import from_dict
from pipeline.tracking import stage_run
with stage_run("pretrain", from_dict({})):
    print("started", flush=True)
    time.sleep(60)
"""


def test_stage_run__sigterm_marks_killed(db, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=os.environ.copy())
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    c = MlflowClient(db)
    runs = c.search_runs([c.get_experiment_by_name("moco-pipeline").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]


def test_stage_run__shards_logged_as_dataset_input(db, tmp_path):
    import hashlib

    split = tmp_path / "shards/pretrain"
    split.mkdir(parents=True)
    (split / "manifest.json").write_text('{"source": "fashion_mnist", "split": "pretrain"}')
    with stage_run("pretrain", from_dict({})) as r:
        r.log_shards(split, context="training")
    run = MlflowClient(db).get_run(json.loads((tmp_path / "runs/pretrain.json").read_text())
                                   ["run_id"])
    (ds,) = run.inputs.dataset_inputs
    assert ds.dataset.name == "fashion_mnist/pretrain"
    want = hashlib.sha256((split / "manifest.json").read_bytes()).hexdigest()[:36]
    assert ds.dataset.digest == want
