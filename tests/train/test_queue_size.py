"""The queue against the data (moco#146): K >= N refused before training, K >= N/2 warned."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import TINY, build_tiny_shards

from pipeline.config import from_dict
from pipeline.data.shards import read_manifest
from pipeline.train.plan import PlanError, plan_run

ROOT = Path(__file__).resolve().parents[2]


def _plan(shards, K):
    p = from_dict({**TINY, "moco": {"K": K, "bn_splits": 2}})
    return plan_run(read_manifest(shards / "pretrain"), shards / "pretrain", opt=p.pretrain,
                    moco=p.moco, world_size=1, cuda=False)


def test_plan_run__queue_at_least_the_images_refused_naming_both(tiny_shards):
    with pytest.raises(PlanError) as e:
        _plan(tiny_shards, 192)  # the tiny shards hold 192 pretraining images
    msg = str(e.value)
    assert msg.startswith("params: 'moco.K' = 192 is invalid; allowed: < 192, the number of "
                          f"pretraining images ({tiny_shards / 'pretrain'})")
    assert "moco#146" in msg and "\n" not in msg
    assert _plan(tiny_shards, 191).total_steps == 2 * (192 // 16)


def test_plan_run__queue_at_half_the_images_warns(tiny_shards, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.train.plan"):
        _plan(tiny_shards, 95)
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="pipeline.train.plan"):
        _plan(tiny_shards, 96)  # 2 K = N
    (rec,) = caplog.records
    assert "moco.K = 96 is at least half the pretraining set (192 images)" in rec.getMessage()


def test_pretrain_stage__queue_longer_than_data_refused_before_anything(tmp_path):
    wd = tmp_path / "wd"
    build_tiny_shards(wd / "data" / "shards", n_pretrain=64, n_train=16, n_test=16)
    tree = json.loads(json.dumps(TINY))
    tree["moco"]["K"] = 100
    tree["mlflow"] = {"enabled": True}
    (wd / "params.yaml").write_text(yaml.safe_dump(tree))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'never' / 'x.db'}"}
    res = subprocess.run([sys.executable, str(ROOT / "stages/pretrain.py"), "--params",
                          "params.yaml"], cwd=wd, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [res.stderr.strip().splitlines()[-1]] and len(errors) == 1
    assert errors[0].startswith("error: params.yaml: 'moco.K' = 100 is invalid; allowed: < 64, the "
                                "number of pretraining images (data/shards/pretrain)")
    # nothing touched: no model, no checkpoint, no run record, no MLflow database
    assert sorted(p.name for p in wd.iterdir()) == ["data", "params.yaml"]
    assert not (tmp_path / "never").exists()


def _check_data(wd: Path, K: int) -> subprocess.CompletedProcess:  # noqa: N803 (MoCo's K)
    tree = json.loads(json.dumps(TINY))
    tree["moco"]["K"] = K
    (wd / "params.yaml").write_text(yaml.safe_dump(tree))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "stages/check_data.py"), "--params",
                           "params.yaml"], cwd=wd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_check_data_stage__refuses_from_the_manifest_and_writes_a_content_stable_stamp(tmp_path):
    # the stage DVC runs between build_shards and pretrain: the same check, on the manifest only
    wd = tmp_path / "wd"
    build_tiny_shards(wd / "data" / "shards", n_pretrain=64, n_train=16, n_test=16)
    res = _check_data(wd, 64)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [res.stderr.strip().splitlines()[-1]] and len(errors) == 1
    assert errors[0].startswith("error: params.yaml: 'moco.K' = 64 is invalid; allowed: < 64, the "
                                "number of pretraining images (data/shards/pretrain)")
    assert not (wd / "runs").exists()
    stamps = []
    for K in (63, 8):
        assert _check_data(wd, K).returncode == 0
        stamps.append((wd / "runs/check_data.json").read_bytes())
    assert stamps[0] == stamps[1] and json.loads(stamps[0])["stage"] == "check_data"
