"""Numerics at the stage level: a NaN loss ends the MLflow run FAILED, exports nothing, and the
last checkpoint stays usable (a restart resumes it and ends bit-identical to the reference)."""

from __future__ import annotations

import re
import subprocess
import textwrap

import pytest
import torch
from relhelpers import (
    PY,
    ROOT,
    checkpoint_file,
    leftover_temp_files,
    load_state,
    mlflow_runs,
    run_stage,
    same_tensors,
    stage_env,
    write_params,
)

# The real stage script, run as __main__, with the loss poisoned from the 6th step on.
POISONED_STAGE = textwrap.dedent("""
    import runpy, sys
    import pipeline.moco.model as model_mod
    real, calls = model_mod.info_nce, [0]
    def poisoned(*a, **k):
        loss, logits = real(*a, **k)
        calls[0] += 1
        return (loss * float("nan") if calls[0] > 5 else loss), logits
    model_mod.info_nce = poisoned
    sys.argv = [{stage!r}, "--params", "params.yaml"]
    runpy.run_path({stage!r}, run_name="__main__")
""").format(stage=str(ROOT / "stages" / "pretrain.py"))


@pytest.mark.slow
def test_pretrain_stage__nan_loss__run_failed_checkpoint_usable(workdir, mlflow_db,
                                                                reference_encoder):
    write_params(workdir / "params.yaml", mlflow=True)
    r = subprocess.run([PY, "-c", POISONED_STAGE], cwd=workdir, env=stage_env(mlflow_db),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "NonFiniteLossError" in last and "at step 5" in last, r.stderr[-3000:]
    assert [x.info.status for x in mlflow_runs(mlflow_db)] == ["FAILED"]
    assert not (workdir / "models/encoder.pt").exists()
    assert not (workdir / "runs/pretrain.json").exists()
    assert leftover_temp_files(workdir) == []
    ck = torch.load(checkpoint_file(workdir), map_location="cpu", weights_only=True)
    assert ck["step"] == 4 and re.fullmatch(r"[0-9a-f]{64}", ck["fingerprint"])
    assert all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())

    r = run_stage("pretrain", workdir, db=mlflow_db)  # the fault is gone: resume
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {checkpoint_file(workdir).relative_to(workdir)} at step 4" in r.stderr
    assert same_tensors(load_state(workdir / "models/encoder.pt"), reference_encoder)
    (run,) = mlflow_runs(mlflow_db)  # the failed training continued: one run, FINISHED
    assert run.info.status == "FINISHED" and "failed.reason" not in run.data.tags
    assert run.data.tags["interrupted.1"].startswith("FAILED: NonFiniteLossError: ")


@pytest.mark.slow
def test_pretrain_stage__absurd_lr__non_finite_loss_run_failed(workdir, mlflow_db):
    # lr 1e30 per 256 images: the first SGD step overflows the weights, the 2nd loss is NaN
    write_params(workdir / "params.yaml", {"pretrain": {"lr": 1e30}}, mlflow=True)
    r = run_stage("pretrain", workdir, db=mlflow_db)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "NonFiniteLossError" in last and "(nan) at step 1 " in last, r.stderr[-3000:]
    assert [x.info.status for x in mlflow_runs(mlflow_db)] == ["FAILED"]
    assert not (workdir / "models").exists()  # nothing exported, no checkpoint before step 2
    assert not (workdir / "runs").exists()
