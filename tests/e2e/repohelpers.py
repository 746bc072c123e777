"""A copy of the working tree as a fresh git + DVC repo in tmp, with a tiny recipe: the one
repo-copy helper of the e2e tests (:func:`make_repo`, :func:`sh`, :func:`params`)."""

from __future__ import annotations

import copy
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]

# Every stage of dvc.yaml in file order, which is the order a first `dvc repro` runs them in
# (each stage's deps come from stages above it).
STAGES: list[str] = list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])

# On top of configs/ci.yaml: 16 px images, a width-4 ResNet, one epoch: seconds per stage. No
# MLflow (each stage starts ~3 s sooner: no mlflow import, no database): the tests of tracking
# turn it on (test_pipeline, test_experiments, test_remote_shards, the no-labels registry test).
TINY: dict[str, dict[str, Any]] = {
    "mlflow": {"enabled": False},
    "data": {"image_size": 16, "samples_per_shard": 64, "max_pretrain_images": 0,
             "max_train_images": 0, "max_test_images": 0},
    "model": {"width": 4, "head_hidden": 16, "dim": 16},
    "moco": {"K": 64},
    "pretrain": {"epochs": 1, "batch_size": 32, "knn_every_epochs": 1,
                 "knn_monitor_train_images": 100, "knn_monitor_test_images": 50,
                 "checkpoint_every_steps": 0, "log_every_steps": 2},
    "embed": {"batch_size": 64, "pool_grid": 1},
    "knn": {"k": 5, "select": "fixed"},
    "linear": {"epochs": 2, "batch_size": 32, "lr_milestones": [1, 2]},
    "report": {"tsne_points": 20, "retrieval_queries": 2, "retrieval_neighbours": 2},
    "selection": {"budget": [4, 8], "draws": 2},
}


def sh(cmd: list[str], cwd: Path, env: dict, *, ok: bool = True,
       timeout: float = 1200) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert proc.returncode == 0, (f"{cmd} failed:\n{proc.stdout[-4000:]}\n"
                                      f"{proc.stderr[-4000:]}")
    return proc


def out(p: subprocess.CompletedProcess) -> str:
    return p.stdout + p.stderr


def ran(output: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", output)


def params(overrides: dict[str, dict[str, Any]],
           tiny: dict[str, dict[str, Any]] | None = TINY) -> dict[str, Any]:
    """configs/ci.yaml + ``tiny`` (:data:`TINY`; None: ci.yaml as it is) + ``overrides``."""
    tree = yaml.safe_load((ROOT / "configs/ci.yaml").read_text())
    for layer in (tiny or {}, overrides):
        for sec, vals in copy.deepcopy(layer).items():
            tree[sec].update(vals)
    return tree


BESIDE, PROJECT_DEFAULT = "beside", "project default"  # make_repo(mlflow=...)


def make_repo(dst: Path, tree: dict[str, Any], *,
              mlflow: str | Path = BESIDE) -> dict[str, str]:
    """Copy the working tree to ``dst`` (no dvc.lock, metrics, plots, results), write the params,
    ``git init`` + commit; returns the environment for ``dvc``.

    Args:
        dst: the new repo's directory.
        tree: the params (:func:`params`).
        mlflow: where MLflow logs: :data:`BESIDE` (``<dst>-mlflow.db`` beside the repo: inside,
            `dvc exp run` would stash and restore it with the workspace), :data:`PROJECT_DEFAULT`
            (no ``MLFLOW_TRACKING_URI``: the project's ``<repo>/mlflow.db``), or a database path.
    """
    dst.mkdir(parents=True, exist_ok=True)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file() and not f.startswith(("results/", "metrics/", "plots/")):
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    (dst / "dvc.lock").unlink(missing_ok=True)
    (dst / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "MLFLOW_"))}
    env.update({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                "PYTHONPATH": str(dst), "DVC_NO_ANALYTICS": "1",
                "GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@localhost",
                "GIT_COMMITTER_NAME": "ci", "GIT_COMMITTER_EMAIL": "ci@localhost"})
    # one thread per stage: `make test` runs a file per core, and a stage on every core would
    # spin against the other files' stages
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    if mlflow == BESIDE:
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{dst.parent / (dst.name + '-mlflow.db')}"
    elif mlflow != PROJECT_DEFAULT:
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{mlflow}"
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "base"]):
        sh(cmd, dst, env)
    return env


def commit(dst: Path, env: dict, message: str = "repro") -> None:
    sh(["git", "add", "-A"], dst, env)
    sh(["git", "commit", "-qm", message, "--allow-empty"], dst, env)


def file_digests(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root``, hidden ones included."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
