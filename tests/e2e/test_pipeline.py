"""The whole DVC pipeline at small scale on real Fashion-MNIST (configs/ci.yaml).

A copy of the working tree becomes a fresh git repo in tmp; `configs/ci.yaml` replaces
params.yaml (so DVC sees every value); MLflow logs to a throwaway SQLite database. Then:
metrics are sane, a second `dvc repro` runs only the (always_changed) index_shards stage, which
has nothing to index here, `dvc exp run -S knn.k=...` reruns only knn and report, `-S
pretrain.lr=...` reruns pretrain and everything after it (not build_shards or baselines), and
every executed stage left a FINISHED MLflow run (index_shards logs none without shards).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
STAGES = ["build_shards", "pretrain", "embed", "baselines", "knn", "linear", "report"]
INDEX = "index_shards"  # always_changed: runs at every `dvc repro`, changes nothing here

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST not installed "
                                 "(apt-get install dataset-fashion-mnist; `make setup` does)")]


def sh(cmd: list[str], cwd: Path, env: dict) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def ran(output: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", output)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    dst = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    for stale in ("dvc.lock", "metrics", "plots"):
        if (dst / stale).is_file():
            (dst / stale).unlink()
        elif (dst / stale).is_dir():
            shutil.rmtree(dst / stale)
    shutil.copy(ROOT / "configs/ci.yaml", dst / "params.yaml")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{dst / 'ci-mlflow.db'}",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@localhost",
           "GIT_COMMITTER_NAME": "ci", "GIT_COMMITTER_EMAIL": "ci@localhost"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "ci"]):
        sh(cmd, dst, env)
    out = sh(["dvc", "repro"], dst, env)
    sh(["git", "add", "-A"], dst, env)
    sh(["git", "commit", "-qm", "repro"], dst, env)
    return dst, env, out


def test_pipeline__all_stages_run_with_sane_metrics(repo):
    dst, _, out = repo
    # params validated before any output is touched
    assert ran(out) == ["check_params", INDEX, *STAGES]
    m = {n: json.loads((dst / f"metrics/{n}.json").read_text())
         for n in ("pretrain", "embed", "baselines", "knn", "linear")}
    for name, metrics in m.items():
        for k, v in metrics.items():
            assert isinstance(v, (int, float)), f"metrics/{name}.json: {k} is not numeric"
    assert m["embed"]["train_images"] == 2000 and m["embed"]["test_images"] == 500
    # the report's throughput table reads wall_time_s of every evaluated stage
    for name in ("pretrain", "embed", "baselines", "knn", "linear"):
        assert m[name]["wall_time_s"] > 0, f"metrics/{name}.json has no wall time"
    # both splits' images over both extraction times: between the two per-split rates
    rates = (m["embed"]["train_images_per_s"], m["embed"]["test_images_per_s"])
    assert min(rates) <= m["embed"]["images_per_s"] <= max(rates)
    # ten classes: chance is 10 %
    for top1 in (m["knn"]["top1"], m["linear"]["top1"], m["baselines"]["raw_pixels_top1"]):
        assert 10 < top1 <= 100
    assert m["pretrain"]["steps"] == 2 * (2048 // 64)
    assert (dst / "reports/report.html").stat().st_size > 10_000
    from pipeline.report.check import check_html

    assert check_html(dst / "reports/report.html") == []


def test_pipeline__second_repro_is_noop(repo):
    dst, env, _ = repo
    out = sh(["dvc", "repro"], dst, env)
    assert ran(out) == [INDEX]
    status = sh(["dvc", "status"], dst, env)
    assert status.split() == [f"{INDEX}:", "always", "changed"], status


def test_pipeline__knn_param_reruns_only_knn_and_report(repo):
    dst, env, _ = repo
    out = sh(["dvc", "exp", "run", "-S", "knn.k=20"], dst, env)
    assert ran(out) == ["check_params", INDEX, "knn", "report"]  # both outputs content-stable
    assert json.loads((dst / "metrics/knn.json").read_text())["k"] == 20


def test_pipeline__pretrain_param_reruns_pretrain_and_after(repo):
    dst, env, _ = repo
    out = sh(["dvc", "exp", "run", "-S", "pretrain.lr=0.05"], dst, env)
    assert ran(out) == ["check_params", INDEX, "pretrain", "embed", "knn", "linear", "report"]


def test_pipeline__mlflow_has_finished_runs_per_stage(repo):
    dst, env, _ = repo
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("moco-pipeline")
    runs = client.search_runs([exp.experiment_id], max_results=500)
    by_stage: dict[str, list[str]] = {}
    for r in runs:
        by_stage.setdefault(r.data.tags["stage"], []).append(r.info.status)
    assert set(by_stage) == set(STAGES)
    assert all(s == "FINISHED" for statuses in by_stage.values() for s in statuses)
    report = [r for r in runs if r.data.tags["stage"] == "report"]
    assert all("knn.top1" in r.data.metrics and "moco.K" in r.data.params for r in report)
    # lineage: the report run names the runs of every upstream stage
    assert all(r.data.tags.get("upstream.pretrain", "unknown") != "unknown" for r in report)
