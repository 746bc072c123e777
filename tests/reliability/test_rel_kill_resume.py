"""Kill and resume: SIGTERM / SIGKILL of ``stages/pretrain.py`` at random steps, then restart.

The kill point is drawn from a seeded RNG: the step whose log line triggers the signal, plus a
small delay. Whatever the point, the restarted stage must end with an encoder bit-identical to
the uninterrupted reference run of the same params, in ONE MLflow run (the interrupted run
continued, FINISHED, its metric steps continuous).
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
from mlflow.tracking import MlflowClient
from relhelpers import (
    TOTAL_STEPS,
    checkpoint_file,
    leftover_temp_files,
    load_state,
    mlflow_runs,
    run_stage,
    same_tensors,
    stage_cmd,
    stage_env,
    write_params,
)

from pipeline.train.checkpoint import load_checkpoint


def loss_steps(db, run_id: str) -> list[int]:
    """The steps of a run's ``loss`` metric, in logging order."""
    client = MlflowClient(f"sqlite:///{db}")
    return sorted(m.step for m in client.get_metric_history(run_id, "loss"))


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
@pytest.mark.parametrize(("sig", "seed"), [(signal.SIGTERM, 1), (signal.SIGINT, 2)],
                         ids=["SIGTERM", "SIGINT"])
def test_pretrain_stage__signal_then_restart__killed_run_and_bit_identical(
        sig, seed, workdir, mlflow_db, reference_encoder):
    # SIGINT is what Ctrl-C sends: it must behave as SIGTERM does (checkpoint, one line), exit 130
    write_params(workdir / "params.yaml", mlflow=True)
    at_step, delay = kill_point(seed, first=2)
    rc, err = start_and_signal(workdir, mlflow_db, sig, at_step, delay)

    name = signal.Signals(sig).name
    assert rc == 128 + sig, err[-3000:]  # 143 for SIGTERM, 130 for SIGINT
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, err[-3000:]  # one clear line, not a stack
    last = err.strip().splitlines()[-1]
    assert last == errors[0]
    assert last.startswith(f"error: Terminated: {name}") and "rerun `dvc repro`" in last, last
    m = re.search(rf"{name}: checkpoint written at step (\d+)", err)
    assert m, err[-3000:]
    stopped = int(m.group(1))
    assert at_step <= stopped < TOTAL_STEPS
    ckpt_path = checkpoint_file(workdir)
    assert f"{name}: checkpoint written at step {stopped} to {ckpt_path.relative_to(workdir)};" \
        in last
    ck = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    assert ck["step"] == stopped and re.fullmatch(r"[0-9a-f]{64}", ck["fingerprint"])
    assert not (workdir / "models/encoder.pt").exists()
    assert not (workdir / "runs/pretrain.json").exists()  # only a finished run is recorded
    assert leftover_temp_files(workdir) == []
    (killed,) = mlflow_runs(mlflow_db)
    assert killed.info.status == "KILLED" and killed.info.end_time is not None
    assert killed.data.tags["killed.reason"].startswith(f"{name}: checkpoint written")

    assert ck["mlflow_run_id"] == killed.info.run_id  # the checkpoint names its run

    r = run_stage("pretrain", workdir, db=mlflow_db)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {ckpt_path.relative_to(workdir)} at step {stopped}" in r.stderr
    assert same_tensors(load_state(workdir / "models/encoder.pt"), reference_encoder)
    # one training = one run: the KILLED run continues, RUNNING again, then FINISHED
    (run,) = mlflow_runs(mlflow_db)
    assert run.info.run_id == killed.info.run_id and run.info.status == "FINISHED"
    tags = run.data.tags
    assert "killed.reason" not in tags and tags["interrupted.count"] == "1"
    assert tags["interrupted.1"].startswith(
        f"KILLED: {name}: checkpoint written at step {stopped} to "
        f"{ckpt_path.relative_to(workdir)}; resumed from the checkpoint by pid")
    # every logged step once, from the first to the last (SIGTERM checkpoints at its step)
    assert loss_steps(mlflow_db, run.info.run_id) == list(range(2, TOTAL_STEPS + 1, 2))
    recorded = json.loads((workdir / "runs/pretrain.json").read_text())
    assert recorded["run_id"] == run.info.run_id


@pytest.mark.slow
def test_pretrain_stage__sigkill_then_restart__stale_run_killed_and_bit_identical(
        workdir, mlflow_db, reference_encoder):
    write_params(workdir / "params.yaml", mlflow=True)
    at_step, delay = kill_point(3, first=4)  # step >= 4: a checkpoint exists before the kill
    rc, err = start_and_signal(workdir, mlflow_db, signal.SIGKILL, at_step, delay)
    assert rc == -signal.SIGKILL
    ck = torch.load(checkpoint_file(workdir), weights_only=True)
    assert 2 <= ck["step"] < TOTAL_STEPS
    # MLflow cannot see a SIGKILL: the run is left RUNNING ...
    (stale,) = mlflow_runs(mlflow_db)
    assert stale.info.status == "RUNNING"

    r = run_stage("pretrain", workdir, db=mlflow_db)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"resuming from \.checkpoints/pretrain/[0-9a-f]{16}/last\.pt at step \d+",
                     r.stderr)
    assert same_tensors(load_state(workdir / "models/encoder.pt"), reference_encoder)
    # ... until the stage starts again: the sweep marks it KILLED (its owner is dead), then the
    # resumed training continues that same run to FINISHED, the reason kept as interrupted.1
    assert "was left RUNNING by a dead process: marked KILLED" in r.stderr
    (run,) = mlflow_runs(mlflow_db)
    assert run.info.run_id == stale.info.run_id and run.info.status == "FINISHED"
    tags = run.data.tags
    assert "stale.reason" not in tags and tags["interrupted.count"] == "1"
    assert tags["interrupted.1"].startswith("KILLED: process ") and "SIGKILL" in tags[
        "interrupted.1"]
    assert tags["proc.pid"] != stale.data.tags["proc.pid"]  # owned by the resuming process
    # steps logged after the last checkpoint were logged again by the resumed process, with the
    # same values (bit-identical resume): every step present, no two values for one step
    history = MlflowClient(f"sqlite:///{mlflow_db}").get_metric_history(run.info.run_id, "loss")
    by_step: dict[int, set[float]] = {}
    for m in history:
        by_step.setdefault(m.step, set()).add(m.value)
    assert sorted(by_step) == list(range(2, TOTAL_STEPS + 1, 2))
    assert all(len(v) == 1 for v in by_step.values())


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

    monkeypatch.setattr(torch, "save", half_then_fail)  # what pipeline.atomic calls
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
