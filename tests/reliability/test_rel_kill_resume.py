"""Kill and resume: SIGTERM / SIGKILL of ``stages/pretrain.py`` at random steps, then restart.

The kill point is drawn from a seeded RNG: the step whose log line triggers the signal, plus a
small delay. Whatever the point, the restarted stage must end with an encoder bit-identical to
the uninterrupted reference run of the same params.
"""

from __future__ import annotations

import io
import json
import random
import re
import signal
import subprocess
import time

import pytest
import torch
from helpers import run_pretrain
from relhelpers import (
    TOTAL_STEPS,
    leftover_temp_files,
    load_state,
    mlflow_runs,
    run_stage,
    same_tensors,
    stage_cmd,
    stage_env,
    write_params,
)

import pipeline.atomic as atomic
from pipeline.checkpoint import load_checkpoint


def kill_point(seed: int, first: int) -> tuple[int, float]:
    """(logged step after which to signal, extra delay in s), reproducible from ``seed``."""
    rng = random.Random(seed)
    return rng.randrange(first, TOTAL_STEPS - 8, 2), rng.uniform(0.0, 0.1)


def start_and_signal(wd, db, sig: int, at_step: int, delay: float) -> tuple[int, str]:
    """Start the pretrain stage, send ``sig`` once it logged ``step at_step/``; (rc, stderr)."""
    proc = subprocess.Popen(stage_cmd("pretrain"), cwd=wd, env=stage_env(db),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if f" step {at_step}/{TOTAL_STEPS} " in line:
                break
        else:
            pytest.fail("the stage ended before the kill point:\n" + "".join(seen)[-3000:])
        time.sleep(delay)
        proc.send_signal(sig)
        _, rest = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(seen) + rest


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_pretrain_stage__sigterm_then_restart__killed_run_and_bit_identical(
        seed, workdir, mlflow_db, reference_encoder):
    write_params(workdir / "params.yaml", mlflow=True)
    at_step, delay = kill_point(seed, first=2)
    rc, err = start_and_signal(workdir, mlflow_db, signal.SIGTERM, at_step, delay)

    assert rc == 143, err[-3000:]  # 128 + SIGTERM
    assert "Traceback" not in err, err[-3000:]  # one clear line, not a stack
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: Terminated: SIGTERM") and "rerun `dvc repro`" in last, last
    m = re.search(r"SIGTERM: checkpoint written at step (\d+)", err)
    assert m, err[-3000:]
    stopped = int(m.group(1))
    assert at_step <= stopped < TOTAL_STEPS
    ckpt_path = workdir / "models/checkpoints/last.pt"
    ck = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    assert ck["step"] == stopped and re.fullmatch(r"[0-9a-f]{64}", ck["fingerprint"])
    assert not (workdir / "models/encoder.pt").exists()
    assert not (workdir / "runs/pretrain.json").exists()  # only a finished run is recorded
    assert leftover_temp_files(workdir) == []
    assert [r.info.status for r in mlflow_runs(mlflow_db)] == ["KILLED"]

    r = run_stage("pretrain", workdir, db=mlflow_db)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from models/checkpoints/last.pt at step {stopped}" in r.stderr
    assert same_tensors(load_state(workdir / "models/encoder.pt"), reference_encoder)
    runs = mlflow_runs(mlflow_db)
    assert [x.info.status for x in runs] == ["KILLED", "FINISHED"]
    recorded = json.loads((workdir / "runs/pretrain.json").read_text())
    assert recorded["run_id"] == runs[1].info.run_id


@pytest.mark.slow
def test_pretrain_stage__sigkill_then_restart__bit_identical(workdir, mlflow_db,
                                                             reference_encoder):
    write_params(workdir / "params.yaml", mlflow=True)
    at_step, delay = kill_point(3, first=4)  # step >= 4: a checkpoint exists before the kill
    rc, err = start_and_signal(workdir, mlflow_db, signal.SIGKILL, at_step, delay)
    assert rc == -signal.SIGKILL
    ck = torch.load(workdir / "models/checkpoints/last.pt", weights_only=True)
    assert 2 <= ck["step"] < TOTAL_STEPS
    # MLflow cannot see a SIGKILL: the run stays RUNNING (documented), never FINISHED
    assert [x.info.status for x in mlflow_runs(mlflow_db)] == ["RUNNING"]

    r = run_stage("pretrain", workdir, db=mlflow_db)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"resuming from models/checkpoints/last.pt at step \d+", r.stderr)
    assert same_tensors(load_state(workdir / "models/encoder.pt"), reference_encoder)
    assert [x.info.status for x in mlflow_runs(mlflow_db)] == ["RUNNING", "FINISHED"]


@pytest.mark.parametrize("interrupt", [RuntimeError("disk went away"), KeyboardInterrupt()])
def test_checkpoint_write__interrupted_inside_torch_save__previous_kept(
        interrupt, tiny_shards, tmp_path, monkeypatch, reference_encoder):
    run_pretrain(tiny_shards, tmp_path, max_steps=2)  # checkpoint at step 2
    ckpt = tmp_path / "ckpt/last.pt"
    before = ckpt.read_bytes()
    fp = torch.load(ckpt, weights_only=True)["fingerprint"]
    real_save = torch.save
    written = []

    def half_then_fail(obj, f, *a, **k):
        buf = io.BytesIO()
        real_save(obj, buf)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        written.append(len(data) // 2)
        raise interrupt

    monkeypatch.setattr(atomic.torch, "save", half_then_fail)
    with pytest.raises(type(interrupt)):
        run_pretrain(tiny_shards, tmp_path)  # resumes at 2, the save at step 4 dies mid-write
    monkeypatch.undo()

    assert written and written[0] > 0
    assert ckpt.read_bytes() == before
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["last.pt"]  # no temp file
    state = load_checkpoint(ckpt, fp)
    assert state is not None and state["step"] == 2
    run_pretrain(tiny_shards, tmp_path)  # and the run still completes, bit-identically
    assert same_tensors(load_state(tmp_path / "encoder.pt"), reference_encoder)
