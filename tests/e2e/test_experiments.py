"""Experiments that don't retrain, and MLflow runs that stay truthful (issues #15 and #16.3).

One tiny pipeline on real Fashion-MNIST (configs/ci.yaml shrunk: 256 pretraining images, 2
pretraining steps) in a fresh git repo with the DEFAULT tracking setup (``<repo>/mlflow.db``,
artifacts in ``<repo>/mlartifacts``), pushed to a local-directory DVC remote. The tests run in
file order on that one repo:

1. the baseline ran every stage, check_params first; metrics are rounded; MLflow runs are
   FINISHED, in the repo's artifact store, in an experiment tagged as model development;
2. a clone + ``dvc pull`` is up to date and ``dvc repro`` runs nothing but the index (which has
   nothing to index and logs no run);
3. from NO ``mlflow.db``, three queued ``-S knn.k=...`` experiments run with ``-j 3``: all
   finish, pretrain never reruns, artifacts land in the repo (not the deleted temp workspaces);
4. ``--temp`` likewise (both up to ``knn``: that a knn param reruns the report too is
   test_pipeline's);
5. ``pretrain.lr`` flip-flop: the second run restores pretrain from the run cache;
6. a params typo: ``dvc repro`` fails with one line and every previous output is intact;
7. ``cp -a`` of the repo: a stage run in the copy puts its artifacts inside the copy.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from repohelpers import PROJECT_DEFAULT, STAGES, make_repo, out, params, ran, sh

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
INDEX = "index_shards"  # always_changed: runs at every `dvc repro`; nothing to index here
# the validations (check_params, check_data, check_eval) and an empty index log no MLflow run
TRACKED = [s for s in STAGES[2:] if s not in ("check_data", "check_eval")]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST not installed "
                                 "(apt-get install dataset-fashion-mnist; `make setup` does)")]

TINY = {  # on top of configs/ci.yaml: seconds per stage
    "data": {"max_pretrain_images": 256, "max_train_images": 200, "max_test_images": 100},
    "model": {"width": 4, "head_hidden": 16, "dim": 16},
    "moco": {"K": 64},
    "pretrain": {"epochs": 1, "steps_per_epoch": 2, "batch_size": 32, "knn_every_epochs": 0,
                 "checkpoint_every_steps": 0, "log_every_steps": 1},
    "embed": {"batch_size": 256},
    "knn": {"k": 10},
    "linear": {"epochs": 2, "batch_size": 64, "lr_milestones": [1, 2]},
    "report": {"tsne_points": 60, "retrieval_queries": 2, "retrieval_neighbours": 2},
}


READ_RUNS = """
import json, sys
from mlflow.tracking import MlflowClient
c = MlflowClient(sys.argv[1])
ids = [e.experiment_id for e in c.search_experiments()]
print(json.dumps([{
    "run_id": r.info.run_id, "status": r.info.status, "start": r.info.start_time,
    "artifact_uri": r.info.artifact_uri, "stage": r.data.tags.get("stage"),
    "exp_name": r.data.tags.get("dvc.exp_name"), "lr": r.data.params.get("pretrain.lr"),
    "k": r.data.params.get("knn.k")} for r in c.search_runs(ids, max_results=1000)]))
"""


def runs(db: Path, stage: str | None = None) -> list[dict]:
    """MLflow runs of every experiment in ``db`` (optionally of one stage), oldest first.

    Read in a fresh process: MLflow keeps a connection per database URI open for the life of a
    process, which would still read a database file that a test deleted.
    """
    if not db.exists():
        return []
    res = subprocess.run([sys.executable, "-c", READ_RUNS, f"sqlite:///{db}"],
                         capture_output=True, text=True, timeout=300, check=True)
    found = sorted(json.loads(res.stdout), key=lambda r: r["start"])
    return [r for r in found if stage is None or r["stage"] == stage]


READ_VERSIONS = """
import json, sys
from mlflow.tracking import MlflowClient
c = MlflowClient(sys.argv[1])
print(json.dumps([{"version": str(v.version), "md5": v.tags.get("encoder.md5"),
                   "run_id": v.run_id} for v in c.search_model_versions("name = 'moco-encoder'")]))
"""


def versions(db: Path) -> list[dict]:
    """The versions of ``moco-encoder`` in ``db`` (read in a fresh process, as :func:`runs`)."""
    res = subprocess.run([sys.executable, "-c", READ_VERSIONS, f"sqlite:///{db}"],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(res.stdout)


def describe(found: list[dict]) -> list[tuple]:
    """(stage, status, DVC experiment, pretrain.lr, knn.k) of runs, for assertion messages."""
    return [(r["stage"], r["status"], r["exp_name"], r["lr"], r["k"]) for r in found]


def digest(root: Path, rel: list[str]) -> dict[str, str]:
    files = {}
    for r in rel:
        for p in sorted([root / r] if (root / r).is_file() else (root / r).rglob("*")):
            if p.is_file():
                files[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    dst = tmp_path_factory.mktemp("exprepo") / "repo"
    env = make_repo(dst, params(TINY, tiny=None), mlflow=PROJECT_DEFAULT)
    sh(["dvc", "remote", "add", "-d", "store", str(dst.parent / "remote")], dst, env)
    base = sh(["dvc", "repro"], dst, env)
    for cmd in (["git", "add", "-A"], ["git", "commit", "-qm", "repro"], ["dvc", "push"]):
        sh(cmd, dst, env)
    return dst, env, out(base)


def test_baseline__all_stages_ran_check_params_first(repo):
    _, _, base = repo
    assert ran(base) == STAGES


def test_baseline__metrics_rounded_to_their_precision(repo):
    dst, _, _ = repo
    for f in sorted((dst / "metrics").glob("*.json")):
        for k, v in json.loads(f.read_text()).items():
            if not isinstance(v, float):
                continue
            if re.search(r"(^|_)(top\d+|acc)($|_)", k):
                assert round(v, 2) == v, f"{f.name}: {k} = {v!r}"
            else:
                assert float(f"{v:.6g}") == v, f"{f.name}: {k} = {v!r}"


def test_baseline__mlflow_runs_finished_in_repo_artifact_store_kind_tag(repo):
    dst, _, _ = repo
    from mlflow.tracking import MlflowClient

    all_runs = runs(dst / "mlflow.db")
    assert sorted(r["stage"] for r in all_runs) == sorted(TRACKED)
    assert all(r["status"] == "FINISHED" for r in all_runs)
    for r in all_runs:
        assert r["artifact_uri"].startswith((dst / "mlartifacts").as_uri() + "/"), r
    exp = MlflowClient(f"sqlite:///{dst / 'mlflow.db'}").get_experiment_by_name("moco-pipeline")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


def test_clone__dvc_pull__up_to_date_and_repro_runs_nothing(repo, tmp_path):
    dst, env, _ = repo
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(dst), str(clone)], tmp_path, env)
    sh(["dvc", "pull"], clone, env)
    status = sh(["dvc", "status"], clone, env)
    assert out(status).split() == [f"{INDEX}:", "always", "changed"], out(status)
    assert ran(out(sh(["dvc", "repro"], clone, env))) == [INDEX]
    assert not (clone / "mlflow.db").exists()  # nothing executed, nothing logged


def test_queue__three_parallel_from_no_db__all_finish_pretrain_not_rerun(repo):
    dst, env, _ = repo
    db = dst / "mlflow.db"
    db.unlink()
    shutil.rmtree(dst / "mlartifacts")
    for k in (3, 5, 7):
        sh(["dvc", "exp", "run", "--queue", "knn", "-S", f"knn.k={k}"], dst, env)
    sh(["dvc", "queue", "start", "-j", "3"], dst, env)
    # `dvc queue start` returns at once; the workers are done when `dvc queue status` says so
    deadline = time.time() + 900
    while time.time() < deadline:
        status = out(sh(["dvc", "queue", "status"], dst, env))
        if not re.search(r"\b(Queued|Running)\b", status):
            break
        time.sleep(5)
    assert status.count("Success") == 3, status
    assert runs(db, "pretrain") == [], describe(runs(db))  # restored from the cache
    knn = runs(db, "knn")
    assert len(knn) == 3 and all(r["status"] == "FINISHED" for r in knn)
    assert sorted(r["k"] for r in knn) == ["3", "5", "7"]
    # runs/pretrain.json came back from the run cache naming version 1 of the deleted database:
    # the first knn stage registered the encoder again, the two others found it by its md5
    (version,) = versions(db)
    md5 = hashlib.md5((dst / "models/encoder.pt").read_bytes()).hexdigest()
    assert version["md5"] == md5 and version["run_id"] in {r["run_id"] for r in knn}
    # the first run ever was a queued experiment: artifacts still land in the main repo
    for r in runs(db):
        assert r["status"] == "FINISHED"
        assert r["artifact_uri"].startswith((dst / "mlartifacts").as_uri() + "/")
        path = Path(r["artifact_uri"].removeprefix("file://"))
        assert (path / "config/params.resolved.json").is_file()
    # `dvc exp show` lists them: [workspace, {baseline commit, "experiments": [{"revs": [...]}]}]
    # (the workspace row alone would make the list non-empty, so read the experiments' params)
    shown = json.loads(out(sh(["dvc", "exp", "show", "--json"], dst, env)).strip() or "[]")
    listed = sorted(rev["data"]["params"]["params.yaml"]["data"]["knn"]["k"]
                    for row in shown for exp in row.get("experiments") or []
                    for rev in exp["revs"])
    assert listed == [3, 5, 7], shown


def test_compare__workspace_and_three_experiments_within_160_columns(repo):
    dst, env, _ = repo  # after the three queued knn.k experiments above
    shown = json.loads(out(sh(["dvc", "exp", "show", "--json"], dst, env)))
    top1 = {rev["data"]["params"]["params.yaml"]["data"]["knn"]["k"]:
            rev["data"]["metrics"]["metrics/knn.json"]["data"]["top1"]
            for row in shown for exp in row.get("experiments") or [] for rev in exp["revs"]}
    assert sorted(top1) == [3, 5, 7]
    # not a terminal: 160 columns, as README.md and docs/tracking.md say
    text = sh([sys.executable, "-m", "pipeline", "compare"], dst,
              {k: v for k, v in env.items() if k != "COLUMNS"}).stdout
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= 160, text
    header = lines[0].split()
    assert header[:3] == ["knn.k", "knn.top1", "linear.top1"], text  # the one changed param
    rows = {cells[0]: cells[1:] for cells in (ln.split() for ln in lines[2:7])}
    assert len(rows) == 5, text  # the workspace, the commit, three experiments
    by_k = {int(v[0]): float(v[1]) for v in rows.values() if v[0] in ("3", "5", "7")}
    assert by_k == top1, text


def test_temp__knn_param__pretrain_not_rerun(repo):
    dst, env, _ = repo
    db = dst / "mlflow.db"
    before = len(runs(db, "pretrain"))
    res = sh(["dvc", "exp", "run", "--temp", "knn", "-S", "knn.k=9"], dst, env)
    assert ran(out(res)) == ["check_params", INDEX, "knn"]
    assert len(runs(db, "pretrain")) == before
    assert [r["k"] for r in runs(db, "knn")][-1] == "9", describe(runs(db))


def test_lr_flip_flop__second_run_restores_pretrain_from_run_cache(repo):
    dst, env, _ = repo
    db = dst / "mlflow.db"
    lr = yaml.safe_load((dst / "params.yaml").read_text())["pretrain"]["lr"]
    before = len(runs(db, "pretrain"))
    # up to pretrain (the stages after it follow from its outputs, as in test_pipeline)
    first = out(sh(["dvc", "exp", "run", "-S", "pretrain.lr=0.03", "pretrain"], dst, env))
    assert "pretrain" in ran(first)
    back = out(sh(["dvc", "exp", "run", "-S", f"pretrain.lr={lr}", "pretrain"], dst, env))
    assert "pretrain" not in ran(back), back
    assert "Stage 'pretrain' is cached - skipping run, checking out outputs" in back
    assert len(runs(db, "pretrain")) == before + 1, describe(runs(db))  # only lr=0.03 trained


@pytest.mark.parametrize("key", ["pretrain.lr", "pretrain.lrr"], ids=["value", "key"])
def test_params_typo__repro_fails_one_line_outputs_intact(key, repo):
    dst, env, _ = repo
    good = (dst / "params.yaml").read_text()
    outputs = ["data", "models", "features", "eval", "runs", "reports", "metrics", "plots",
               ".checkpoints"]
    before = digest(dst, outputs)
    assert any(k.startswith("models/") for k in before)
    tree = yaml.safe_load(good)
    if key == "pretrain.lr":
        tree["pretrain"]["lr"] = "0.o6"  # a value typo
    else:
        tree["pretrain"]["lrr"] = tree["pretrain"].pop("lr")  # a key typo
    bad = yaml.safe_dump(tree, sort_keys=False)
    (dst / "params.yaml").write_text(bad)
    try:
        res = sh(["dvc", "repro"], dst, env, ok=False)
        text = out(res)
        assert res.returncode != 0
        assert ran(text) == ["check_params"], text
        errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and f"'{key}'" in errors[0], text
        assert "Traceback" not in text, text
        assert digest(dst, outputs) == before  # every previous output intact
    finally:
        (dst / "params.yaml").write_text(good)
    # fixed (the same bytes as before): nothing to redo, every output is still up to date
    assert ran(out(sh(["dvc", "repro"], dst, env))) == [INDEX]


def test_copied_repo__stage_artifacts_land_inside_the_copy(repo, tmp_path):
    dst, env, _ = repo
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(dst), str(copy)], check=True)
    before = {r["run_id"] for r in runs(copy / "mlflow.db")}
    res = sh(["dvc", "repro", "-f", "-s", "knn"], copy, {**env, "PYTHONPATH": str(copy)})
    assert ran(out(res)) == ["knn"]
    (new,) = [r for r in runs(copy / "mlflow.db") if r["run_id"] not in before]
    assert new["status"] == "FINISHED"
    assert new["artifact_uri"].startswith((copy / "mlartifacts").as_uri() + "/")
    assert (copy / "mlartifacts" / new["run_id"] / "artifacts/config").is_dir()
    assert not list((dst / "mlartifacts").glob(new["run_id"]))
