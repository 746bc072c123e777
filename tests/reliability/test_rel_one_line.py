"""Every failure we can name ends in ONE ``error:`` line (#31), run through the real stage scripts.

- a feature file holding a NaN, in the knn stage;
- an MLflow database created by a NEWER MLflow (its alembic revision unknown here);
- a DataLoader worker killed by its pid (SIGKILL, what the out-of-memory killer sends), and a
  SIGTERM to the whole process group (the worker dies of it first): one line with the signal and
  the checkpoint step, and the restarted stage ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import time

import mlflow
import pytest
import torch
from helpers import says
from relhelpers import (
    TOTAL_STEPS,
    checkpoint_file,
    load_state,
    run_stage,
    same_tensors,
    stage_cmd,
    stage_env,
    write_params,
)

from pipeline.evaluate.features import FeatureSet, save_features


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err[-3000:]
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


def test_knn_stage__nan_in_features__one_error_line(workdir):
    feats = torch.ones(8, 4)
    feats[5, 2] = float("nan")
    keys = [f"k{i}" for i in range(8)]
    save_features(FeatureSet(feats, torch.arange(8) % 4, keys), workdir / "features/train.pt")
    save_features(FeatureSet(torch.ones(4, 4), torch.arange(4), keys[:4]),
                  workdir / "features/test.pt")

    r = run_stage("knn", workdir)

    assert r.returncode == 1, r.stderr[-3000:]
    assert error_lines(r.stderr) == [r.stderr.strip().splitlines()[-1]]
    # by hand: one bad row of eight, the sixth (row 5), key 'k5'
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: InputError: features/train.pt: "), last
    says(last, "1 of 8 feature rows", "NaN or Inf", "row 5, key 'k5'", "models/encoder.pt")
    assert not (workdir / "metrics").exists()


def _stamp(db, revision: str) -> str:
    """Set the database's alembic revision; returns the one MLflow had written (its newest)."""
    with sqlite3.connect(db) as con:
        (head,), = con.execute("select version_num from alembic_version").fetchall()
        con.execute("update alembic_version set version_num = ?", (revision,))
    return head


def test_stage__database_of_a_newer_mlflow__names_both_revisions_and_remedies(workdir,
                                                                              mlflow_db):
    write_params(workdir / "params.yaml", mlflow=True)
    head = _stamp(mlflow_db, "0123456789ab")  # a revision no released MLflow of ours knows

    r = run_stage("knn", workdir, db=mlflow_db)

    assert r.returncode == 1, r.stderr[-3000:]
    assert error_lines(r.stderr) == [
        f"error: TrackingError: MLflow database sqlite:///{mlflow_db} has schema revision "
        f"0123456789ab, which this MLflow ({mlflow.__version__}, newest revision {head}) does "
        "not know: a newer MLflow created or upgraded it, and `mlflow db upgrade` cannot go "
        "back. Upgrade mlflow and mlflow-skinny here to that newer version, or point "
        "MLFLOW_TRACKING_URI at another database"]


def test_stage__database_of_an_older_mlflow__keeps_the_upgrade_advice(workdir, mlflow_db):
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    write_params(workdir / "params.yaml", mlflow=True)
    with sqlite3.connect(mlflow_db) as con:
        (head,), = con.execute("select version_num from alembic_version").fetchall()
    older = ScriptDirectory.from_config(_get_alembic_config("")).get_revision(head).down_revision
    _stamp(mlflow_db, older)

    r = run_stage("knn", workdir, db=mlflow_db)

    assert r.returncode == 1
    (line,) = error_lines(r.stderr)
    assert f"found version {older}, but expected {head}" in line and "mlflow db upgrade" in line


def _start_until_step(wd, step: int, **popen) -> tuple[subprocess.Popen, list[str]]:
    """Start the pretrain stage; return once it logged ``step <step>/``."""
    proc = subprocess.Popen(stage_cmd("pretrain"), cwd=wd, env=stage_env(None),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if f" step {step}/{TOTAL_STEPS} " in line:
            return proc, seen
    proc.wait()
    pytest.fail("the stage ended before the kill point:\n" + "".join(seen)[-3000:])


def _children(pid: int) -> list[int]:
    return [int(p) for p in
            open(f"/proc/{pid}/task/{pid}/children").read().split()]  # noqa: SIM115


def _finish(proc: subprocess.Popen, seen: list[str]) -> str:
    try:
        _, rest = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return "".join(seen) + rest


@pytest.mark.slow
def test_pretrain_stage__worker_killed_by_pid__one_line_with_step_then_bit_identical(
        workdir, reference_encoder):
    write_params(workdir / "params.yaml", {"pretrain": {"num_workers": 1}}, mlflow=False)
    proc, seen = _start_until_step(workdir, 6)
    try:
        (worker,) = _children(proc.pid)  # num_workers: 1
        os.kill(worker, signal.SIGKILL)  # what the out-of-memory killer does
    except BaseException:
        proc.kill()
        raise
    err = _finish(proc, seen)

    assert proc.returncode == 1, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0] == err.strip().splitlines()[-1], err[-3000:]
    ckpt = checkpoint_file(workdir)
    step = torch.load(ckpt, weights_only=True)["step"]
    rel = ckpt.relative_to(workdir)
    what = (f"error: LoaderWorkerError: DataLoader worker (pid {worker}) was killed by SIGKILL, "
            "as the out-of-memory killer does (see `dmesg` or the cgroup's memory.events; fewer "
            "loader workers, a smaller batch or smaller images need less memory); ")
    # between two steps a checkpoint is written at once; inside a step the last one stands
    assert lines[0] in (f"{what}checkpoint written at step {step} to {rel}; rerun to resume "
                        "from it",
                        f"{what}the last checkpoint is at step {step} ({rel}); rerun to resume "
                        "from it"), lines[0]
    assert 4 <= step < TOTAL_STEPS
    assert not (workdir / "models/encoder.pt").exists()

    r = run_stage("pretrain", workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {rel} at step {step}" in r.stderr
    assert same_tensors(load_state(workdir / "models/encoder.pt"), reference_encoder)


@pytest.mark.slow
def test_pretrain_stage__sigterm_to_process_group__one_terminated_line_then_bit_identical(
        workdir, reference_encoder):
    write_params(workdir / "params.yaml", {"pretrain": {"num_workers": 1}}, mlflow=False)
    proc, seen = _start_until_step(workdir, 6, start_new_session=True)
    assert len(_children(proc.pid)) == 1
    time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # a scheduler's stop: every process of the group
    err = _finish(proc, seen)

    assert proc.returncode == 143, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0] == err.strip().splitlines()[-1], err[-3000:]
    ckpt = checkpoint_file(workdir)
    step = torch.load(ckpt, weights_only=True)["step"]
    rel = re.escape(str(ckpt.relative_to(workdir)))
    m = re.fullmatch(
        rf"error: Terminated: SIGTERM: (?:checkpoint written at step (\d+) to {rel}|the last "
        rf"checkpoint is at step (\d+) \({rel}\))( \(a DataLoader worker was killed by SIGTERM "
        r"first\))?; rerun `dvc repro` to continue", lines[0])
    assert m, lines[0]
    assert int(m.group(1) or m.group(2)) == step and 4 <= step < TOTAL_STEPS

    r = run_stage("pretrain", workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {ckpt.relative_to(workdir)} at step {step}" in r.stderr
    assert same_tensors(load_state(workdir / "models/encoder.pt"), reference_encoder)
