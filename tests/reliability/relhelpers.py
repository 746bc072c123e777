"""Helpers of the reliability suite (stage subprocesses, params files, MLflow reads)."""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from helpers import TINY as _TINY
from helpers import rewrite_manifest  # noqa: F401  (re-exported for the reliability tests)

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PY = sys.executable

# the tiny recipe of tests/helpers.py (one fixed thread: a probed count may differ between the
# reference run and a resumed one) + a small embed batch: 192 pretrain images / batch 16 = 12
# steps x 2 epochs
TINY: dict[str, Any] = {**copy.deepcopy(_TINY), "embed": {"batch_size": 32, "pool_grid": 1}}
TOTAL_STEPS = 2 * (192 // 16)
# Bit-identity holds for one intra-op thread count (CPU reductions split work by thread), so
# every run compared here uses one thread: stage subprocesses via the environment, in-process
# runs via the autouse fixture in conftest.py. One thread also keeps a loaded 2-core machine
# from thrashing (OpenMP spin-waits make 2 threads ~10x slower when a core is busy elsewhere).
THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def params_tree(overrides: dict[str, Any] | None = None, *, mlflow: bool = True) -> dict:
    """The tiny recipe as a nested dict, with ``overrides`` merged per section."""
    tree = copy.deepcopy(TINY)
    tree["mlflow"] = {"enabled": mlflow, "experiment": "moco-pipeline"}
    for sec, vals in (overrides or {}).items():
        if isinstance(vals, dict):
            tree.setdefault(sec, {}).update(vals)
        else:
            tree[sec] = vals
    return tree


def write_params(path: Path, overrides: dict[str, Any] | None = None, *,
                 mlflow: bool = True, tree: dict | None = None) -> Path:
    """Write a params YAML file (the tiny recipe + overrides, or ``tree`` verbatim)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = tree if tree is not None else params_tree(overrides, mlflow=mlflow)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def copy_shards(src: Path, dst: Path) -> Path:
    """Copy a shards root (``pretrain/ train/ test/``) to ``dst``."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst)
    return dst


def stage_env(db: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a stage subprocess: MLflow at ``db`` (or a path never created)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "MLFLOW_"))}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{db}" if db else "sqlite:////nonexistent-dir/x.db"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)])
    env.update(THREADS_ENV)
    env.update(extra)
    return env


def stage_cmd(stage: str, params: str = "params.yaml") -> list[str]:
    """The DVC ``cmd`` of a stage, with ``--params``."""
    return [PY, str(ROOT / "stages" / f"{stage}.py"), "--params", params]


def run_stage(stage: str, cwd: Path, params: str = "params.yaml", *, db: Path | None = None,
              timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run ``stages/<stage>.py --params params`` in ``cwd``; capture stdout/stderr as text."""
    return subprocess.run(stage_cmd(stage, params), cwd=cwd, env=stage_env(db, **env),
                          capture_output=True, text=True, timeout=timeout)


STORE = Path(".checkpoints/pretrain")  # the resume store of a stage run in its workdir


def checkpoint_file(wd: Path) -> Path:
    """The one ``last.pt`` of the resume store of a stage run with cwd ``wd`` (no DVC_ROOT)."""
    found = sorted((wd / STORE).glob("*/last.pt"))
    assert len(found) == 1, found
    return found[0]


def store_path(wd: Path, fingerprint: str) -> Path:
    """Where the stage keeps the checkpoint of ``fingerprint`` (pipeline/train/resume_store)."""
    return wd / STORE / fingerprint[:16] / "last.pt"


def load_state(path: Path) -> dict[str, torch.Tensor]:
    """A state dict, loaded the safe way."""
    return torch.load(path, map_location="cpu", weights_only=True)


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same keys and bit-identical tensors (dtype and shape included)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def tree_digest(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root`` (hidden ones included)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def mlflow_runs(db: Path, experiment: str = "moco-pipeline") -> list:
    """All runs of ``experiment`` in the database, oldest first."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = c.search_runs([exp.experiment_id])
    return sorted(runs, key=lambda r: r.info.start_time)


def leftover_temp_files(root: Path) -> list[str]:
    """Files or folders a failed atomic write could leave (``.NAME.*.tmp``, ``.NAME.tmp-*``)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*")
                  if ".tmp" in p.name or ".old-" in p.name)
