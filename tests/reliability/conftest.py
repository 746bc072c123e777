"""Fixtures of the reliability suite: a stage working directory, a reference encoder, MLflow.

Stage scripts run as real subprocesses (``python stages/<name>.py --params FILE``) with the
working directory a fresh tmp folder, exactly as DVC runs them (relative output paths).
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
import torch
from relhelpers import copy_shards, load_state, run_stage, write_params


@pytest.fixture(autouse=True)
def _one_thread():
    """In-process training uses one thread, like the stage subprocesses (see THREADS_ENV)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def workdir(tmp_path: Path, tiny_shards: Path) -> Path:
    """A stage working directory: ``data/shards`` (a copy of the tiny shards) + ``params.yaml``
    with the tiny pretraining recipe and MLflow disabled."""
    wd = tmp_path / "wd"
    copy_shards(tiny_shards, wd / "data" / "shards")
    write_params(wd / "params.yaml", mlflow=False)
    return wd


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, tiny_shards: Path) -> Path:
    """An uninterrupted ``stages/pretrain.py`` run of the tiny recipe (its working directory)."""
    wd = tmp_path_factory.mktemp("reference")
    copy_shards(tiny_shards, wd / "data" / "shards")
    write_params(wd / "params.yaml", mlflow=False)
    r = run_stage("pretrain", wd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" not in r.stderr and "step 2/24" in r.stderr
    return wd


@pytest.fixture(scope="session")
def reference_encoder(reference_run: Path) -> dict:
    """The reference run's exported backbone state dict."""
    return load_state(reference_run / "models" / "encoder.pt")


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory) -> Path:
    """An MLflow SQLite database with its tables created (creation costs seconds per db)."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "template.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    with sqlite3.connect(db) as con:  # no experiment rows beyond MLflow's default one
        assert con.execute("select count(*) from runs").fetchone()[0] == 0
    return db


@pytest.fixture()
def mlflow_db(tmp_path: Path, _mlflow_template: Path) -> Path:
    """A fresh MLflow database for one test (a copy of the template), outside the workdir."""
    db = tmp_path / "mlflow" / "x.db"
    db.parent.mkdir()
    shutil.copyfile(_mlflow_template, db)
    return db
