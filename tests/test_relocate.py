"""A moved repo's MLflow database repointed (#47): ``python -m pipeline relocate-mlflow``.

A tiny encoder is published and scored by the stages' functions in a repo logging to its own
``mlflow.db`` (as ``make run`` does), the repo is moved with a rename, and a fresh process loads
``models:/moco-encoder@champion`` before (it fails: mlflow#3144) and after the command. The
README's way of loading (:func:`pipeline.tracking.resolve_model_uri`) loads it before the
command too, or says in one line to run it.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
from helpers import says
from registryhelpers import publish, score, train_tiny
from test_readme import readme_block

from pipeline.tracking import TrackingError, find_experiment_id, open_experiment, resolve_model_uri
from pipeline.tracking.relocate import _moved

REPO = Path(__file__).resolve().parents[1]
CHAMPION = "models:/moco-encoder@champion"

LOAD = """
import sys, torch, mlflow
model = mlflow.pytorch.load_model("models:/moco-encoder@champion").eval()
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[1])), sys.argv[2])
"""


def _env(**extra: str) -> dict[str, str]:
    """This environment without a tracking URI or DVC root: the repo's own mlflow.db."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "PYTHONPATH")}
    return {**env, **extra}


def _relocate(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "relocate-mlflow", *args], cwd=cwd,
                          env=_env(**env), capture_output=True, text=True, timeout=300)


def _under(db: Path, root: Path) -> dict[str, int]:
    """Rows of each location column naming ``root``, counted with plain SQL."""
    con = sqlite3.connect(db)
    prefixes = (root.as_uri(), str(root))
    counts = {}
    for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                          ("logged_models", "artifact_location"),
                          ("model_versions", "storage_location"), ("model_versions", "source")):
        values = [v for (v,) in con.execute(f"SELECT {column} FROM {table}")]
        counts[f"{table}.{column}"] = sum(
            any(v == p or v.startswith(p + "/") for p in prefixes) for v in values if v)
    counts["repo.root tags"] = sum(con.execute(
        f"SELECT COUNT(*) FROM {t} WHERE key = 'repo.root' AND value = ?", (str(root),)
    ).fetchone()[0] for t in ("experiment_tags", "tags"))
    con.close()
    return counts


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("trained"))


@pytest.fixture(scope="module")
def moved(trained, tmp_path_factory) -> tuple[Path, Path]:
    """``(old root, new root)``: a repo that published and scored its encoder, then ``mv``-ed."""
    base = tmp_path_factory.mktemp("moved")
    repo, new = base / "repo", base / "moved"
    shutil.copytree(trained, repo)
    mp = pytest.MonkeyPatch()
    mp.chdir(repo)
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{repo / 'mlflow.db'}")
    try:
        publish()
        assert score("linear", 80.0) == 1
    finally:
        mp.undo()
        mlflow.set_tracking_uri(None)
    repo.rename(new)
    return repo, new


def test_readme_registry_snippet__moved_repo__loads_before_relocating(moved):
    old, new = moved
    # the README's snippet as a user runs it in the moved repo: its own ./mlflow.db
    out = subprocess.run([sys.executable, "-c", readme_block("Use the trained encoder", 1)],
                         cwd=new, env=_env(PYTHONPATH=str(REPO)), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "torch.Size([1, 32])"  # width 4: 8 * 4
    says(out.stderr, f"{CHAMPION}: the MLflow database names {old}, which is gone",
         "python -m pipeline relocate-mlflow")
    # the folder it loads: the recorded one with the old root replaced, read with plain SQL
    con = sqlite3.connect(new / "mlflow.db")
    (location,) = con.execute("SELECT storage_location FROM model_versions").fetchone()
    con.close()
    assert location.startswith(old.as_uri() + "/")  # the database is not changed
    folder = new / location[len(old.as_uri()) + 1:]
    uri = f"sqlite:///{new / 'mlflow.db'}"
    assert resolve_model_uri(CHAMPION, tracking=uri) == str(folder)
    assert resolve_model_uri(CHAMPION + "/MLmodel", tracking=uri) == str(folder / "MLmodel")
    from pipeline.evaluate.run.embed import load_encoder

    x = torch.randn(4, 1, 16, 16)
    eager, _ = load_encoder(new / "models/encoder.pt", pool_grid=1)
    with torch.no_grad():
        assert torch.equal(mlflow.pytorch.load_model(str(folder)).eval()(x), eager.eval()(x))


def test_resolve_model_uri__moved_without_its_artifacts__one_line_names_the_command(moved):
    old, new = moved
    uri = f"sqlite:///{new / 'mlflow.db'}"
    (new / "mlartifacts").rename(new / "elsewhere")  # e.g. moved without mlartifacts/
    try:
        with pytest.raises(TrackingError) as e:
            resolve_model_uri(CHAMPION, tracking=uri)
    finally:
        (new / "elsewhere").rename(new / "mlartifacts")
    text = str(e.value)
    assert "\n" not in text
    says(text, CHAMPION, f"recorded at {old / 'mlartifacts'}/", str(new / "mlartifacts"),
         "`python -m pipeline relocate-mlflow`")


def test_relocate_mlflow__moved_repo__champion_loads_again(trained, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    shutil.copytree(trained, repo)
    monkeypatch.chdir(repo)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{repo / 'mlflow.db'}")
    try:
        publish()
        assert score("linear", 80.0) == 1
    finally:
        mlflow.set_tracking_uri(None)
    before = _under(repo / "mlflow.db", repo)
    assert before["experiments.artifact_location"] == 2  # Default and moco-pipeline
    assert before["model_versions.storage_location"] == 1
    x = torch.randn(4, 1, 16, 16)
    torch.save(x, tmp_path / "x.pt")
    monkeypatch.chdir(tmp_path)
    moved = tmp_path / "moved"
    repo.rename(moved)  # mv repo moved
    uri = f"sqlite:///{moved / 'mlflow.db'}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def load() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "x.pt"),
                               str(tmp_path / "y.pt")], cwd=elsewhere,
                              env=_env(MLFLOW_TRACKING_URI=uri), capture_output=True, text=True,
                              timeout=300)

    failed = load()
    assert failed.returncode != 0 and "No such artifact: ''" in failed.stderr  # mlflow#3144

    out = _relocate(moved)  # in the moved repo, its default database
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == f"relocated {uri} from {repo} to {moved}: " + ", ".join(
        f"{n} {what}" for what, n in before.items())
    assert _under(moved / "mlflow.db", moved) == before
    assert set(_under(moved / "mlflow.db", repo).values()) == {0}

    loaded = load()
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    from pipeline.evaluate.run.embed import load_encoder

    eager, _ = load_encoder(moved / "models/encoder.pt", pool_grid=1)
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "y.pt"), eager.eval()(x))
    # the stages log to the original experiment again, not to "moco-pipeline (<moved>)"
    eid = json.loads((moved / "runs/pretrain.json").read_text())["experiment_id"]
    assert find_experiment_id(uri, "moco-pipeline", moved) == eid
    again = _relocate(moved)
    assert (again.returncode, again.stdout.strip()) == (
        0, f"nothing to relocate: every repo root that {uri} names exists (a copied repo: "
           "name the original with --from)")


def test_relocate_mlflow__copied_repo__only_with_from(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    monkeypatch.chdir(a)  # MLflow's Default experiment lands in a/mlruns/0
    try:
        open_experiment(f"sqlite:///{a / 'mlflow.db'}", "e", a)
    finally:
        mlflow.set_tracking_uri(None)
    shutil.copytree(a, b)  # cp -a a b: a still exists
    uri = f"sqlite:///{b / 'mlflow.db'}"
    assert _relocate(b).stdout.startswith("nothing to relocate")
    out = _relocate(b, "--from", str(a))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == (
        f"relocated {uri} from {a} to {b}: 2 experiments.artifact_location, "
        "0 runs.artifact_uri, 0 logged_models.artifact_location, "
        "0 model_versions.storage_location, 0 model_versions.source, 1 repo.root tags")
    assert find_experiment_id(uri, "e", b) is not None and find_experiment_id(uri, "e", a) is None


def test_relocate_mlflow__server_or_no_database__one_error_line(tmp_path):
    server = _relocate(tmp_path, MLFLOW_TRACKING_URI="http://127.0.0.1:1")
    assert (server.returncode, server.stderr.strip()) == (
        1, "error: relocate-mlflow: http://127.0.0.1:1 is not a database: a tracking server "
           "keeps artifact locations of its own (its --artifacts-destination); nothing to "
           "relocate here")
    none = _relocate(tmp_path)
    assert (none.returncode, none.stderr.strip()) == (
        1, f"error: relocate-mlflow: no MLflow database at {tmp_path / 'mlflow.db'}")


def test_moved__prefix_at_a_path_boundary_only():
    old, new = Path("/w/repo"), Path("/x/moved")
    assert _moved("file:///w/repo/mlartifacts/1", old, new) == "file:///x/moved/mlartifacts/1"
    assert _moved("/w/repo/mlruns/0", old, new) == "/x/moved/mlruns/0"
    assert _moved("/w/repo", old, new) == "/x/moved"
    assert _moved("/w/repo2/mlartifacts", old, new) is None  # another repo beside it
    assert _moved("models:/m-123", old, new) is None
    assert _moved(None, old, new) is None


def test_open_experiment__moved_repo__warning_names_the_command(tmp_path, monkeypatch, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    monkeypatch.chdir(a)
    try:
        first = open_experiment(f"sqlite:///{a / 'mlflow.db'}", "e", a)
        monkeypatch.chdir(tmp_path)
        a.rename(b)
        uri = f"sqlite:///{b / 'mlflow.db'}"
        assert open_experiment(uri, "e", b) != first  # its own experiment, until relocated
    finally:
        mlflow.set_tracking_uri(None)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"MLflow experiment 'e' stores its artifacts outside this repo; logging to experiment "
        f"'e ({b})' (artifacts in {b / 'mlartifacts'}); {a / 'mlartifacts'} is gone: if this "
        "repo was moved from there, `python -m pipeline relocate-mlflow` repoints the database "
        "(docs/tracking.md)"]
    assert _relocate(b).returncode == 0
    assert find_experiment_id(uri, "e", b) == first
