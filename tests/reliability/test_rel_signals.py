"""Signal windows (#16.4): from a stage's first line to its last, SIGTERM or SIGINT gives ONE
``error:`` line and exit 128 + signum (143 / 130), and never leaves a FINISHED MLflow run for a
stage that exits non-zero.

Windows: start-up (imports, params, MLflow set-up; the signal is sent as soon as the stage's
handler is installed, read from ``/proc/<pid>/status``), during the stage body (outside the
training loop, whose window tests/reliability/test_rel_kill_resume.py covers), and after the
MLflow run was recorded FINISHED but before the process exits.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from relhelpers import ROOT, mlflow_runs, stage_cmd, stage_env, write_params

SIGS = [signal.SIGTERM, signal.SIGINT]
IDS = ["SIGTERM", "SIGINT"]


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (the SigCgt mask of /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(ln for ln in status.splitlines() if ln.startswith("SigCgt:")).split()[1], 16)
    return bool(mask >> (sig - 1) & 1)


def signal_when_handled(cmd: list[str], cwd: Path, env: dict, sig: int) -> tuple[int, str, float]:
    """Start ``cmd``, send ``sig`` the moment it handles SIGTERM; (rc, stderr, seconds waited)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    try:
        while not catches(proc.pid, signal.SIGTERM):
            assert proc.poll() is None and time.time() - t0 < 60, "the handler never came"
            time.sleep(0.001)
        waited = time.time() - t0
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err, waited


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("error: Terminated: "), lines[0]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    return lines[0]


@pytest.mark.parametrize("stage", ["pretrain", "knn"])
@pytest.mark.parametrize("sig", SIGS, ids=IDS)
def test_stage__signal_at_startup__one_line_conventional_exit_nothing_written(
        stage, sig, workdir, mlflow_db):
    write_params(workdir / "params.yaml", mlflow=True)
    before = sorted(p.relative_to(workdir) for p in workdir.rglob("*"))
    runs_before = len(mlflow_runs(mlflow_db))

    rc, err, _ = signal_when_handled(stage_cmd(stage), workdir, stage_env(mlflow_db), sig)

    assert rc == 128 + sig, err[-3000:]  # 143 / 130, not -15 or 1
    line = one_error_line(err)
    assert f"received {signal.Signals(sig).name}" in line
    assert sorted(p.relative_to(workdir) for p in workdir.rglob("*")) == before
    assert all(r.info.status != "FINISHED" for r in mlflow_runs(mlflow_db)[runs_before:])


def test_check_params__signal_at_startup__one_line_exit_143(tmp_path):
    write_params(tmp_path / "params.yaml", mlflow=False)
    cmd = [sys.executable, str(ROOT / "stages/check_params.py"), "--stamp", "runs/x.json"]
    rc, err, _ = signal_when_handled(cmd, tmp_path, stage_env(None), signal.SIGTERM)
    assert rc == 143, err
    one_error_line(err)
    assert not (tmp_path / "runs").exists()


# A stage entry point whose body blocks inside its MLflow run (MODE=block), or which receives a
# signal right after its run was recorded FINISHED (MODE=late): the real stage_entry/stage_run.
STAGE = """
import os, signal, sys, time
from pipeline.cli import stage_entry

def run(p):
    from pipeline.tracking import stage_run
    with stage_run("knn", p):
        print("started", flush=True)
        if os.environ["MODE"] == "block":
            time.sleep(120)
    if os.environ["MODE"] == "late":
        os.kill(os.getpid(), int(os.environ["SIG"]))  # FINISHED already; exit not yet decided
        time.sleep(0.2)

stage_entry("knn", run)
"""


@pytest.mark.parametrize("sig", SIGS, ids=IDS)
def test_stage__signal_inside_mlflow_run__killed_one_line(sig, tmp_path, mlflow_db):
    script = tmp_path / "stage.py"
    script.write_text(STAGE)
    write_params(tmp_path / "params.yaml", mlflow=True)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path,
                            env=stage_env(mlflow_db, MODE="block"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err
    one_error_line(err)
    (run,) = mlflow_runs(mlflow_db)
    assert run.info.status == "KILLED" and run.info.end_time is not None
    assert run.data.tags["killed.reason"] == f"received {signal.Signals(sig).name}"
    assert not (tmp_path / "runs/knn.json").exists()  # written only by a completed stage


@pytest.mark.parametrize("sig", SIGS, ids=IDS)
def test_stage__signal_after_run_finished__run_killed_not_finished(sig, tmp_path, mlflow_db):
    script = tmp_path / "stage.py"
    script.write_text(STAGE)
    write_params(tmp_path / "params.yaml", mlflow=True)
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                       env=stage_env(mlflow_db, MODE="late", SIG=str(int(sig))),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 128 + sig, r.stderr
    assert "as the stage ended" in one_error_line(r.stderr)
    (run,) = mlflow_runs(mlflow_db)
    assert run.info.status == "KILLED"  # the process exits non-zero: never FINISHED
    assert run.data.tags["killed.reason"].startswith(signal.Signals(sig).name)


def test_stage__no_signal__finished_and_exit_0(tmp_path, mlflow_db):
    script = tmp_path / "stage.py"
    script.write_text(STAGE)
    write_params(tmp_path / "params.yaml", mlflow=True)
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                       env=stage_env(mlflow_db, MODE="none"), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert [x.info.status for x in mlflow_runs(mlflow_db)] == ["FINISHED"]
