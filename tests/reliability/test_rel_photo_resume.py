"""Kill -9 mid-epoch on photo shards, restart: the encoder is bit-identical to an uninterrupted run.

The shards hold real-photo JPEGs kept byte for byte (crops of scikit-learn's sample photos,
``data.max_side``: whole images), so every view is cut per image in a loader worker, from a
JPEG decoded at a reduced DCT scale where the boxes allow (32 px views of 320 x 240 photos),
else by ``torchvision.io.decode_jpeg``. The boxes are seeded by (seed, epoch, position, view),
so a resumed epoch cuts the same views.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from helpers import write_photos
from relhelpers import (
    checkpoint_file,
    copy_shards,
    load_state,
    params_tree,
    run_stage,
    same_tensors,
    stage_cmd,
    stage_env,
    write_params,
)

from pipeline.config import DataParams
from pipeline.data.build import build_all

STEPS = 2 * (72 // 16)  # 96 photos, a quarter held out for test: 72 pretraining images


def photo_params(root) -> dict:
    return params_tree({
        "data": {"source": "imagefolder", "root": str(root), "image_size": 32,
                 "max_side": 1024, "test_fraction": 0.25},
        "augment": {"preset": "v2", "crop_min_scale": 0.2},
        "pretrain": {"num_workers": 1, "log_every_steps": 1},
    }, mlflow=False)


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("photo-resume")
    write_photos(base / "photos", count=96, width=320, height=240)
    cwd = os.getcwd()
    os.chdir(base)
    try:
        ms = build_all(DataParams(source="imagefolder", root=str(base / "photos"), image_size=32,
                                  max_side=1024, test_fraction=0.25,
                                  shards_dir=str(base / "shards"), samples_per_shard=20),
                       seed=0, progress=False)
    finally:
        os.chdir(cwd)
    assert ms["pretrain"].num_samples == 72
    assert ms["pretrain"].build["members"]["jpg_copied"] == 72
    return base


@pytest.mark.slow
def test_photo_shards__sigkill_mid_epoch_then_restart__bit_identical(photo_shards, tmp_path):
    ref, wd = tmp_path / "ref", tmp_path / "wd"
    for d in (ref, wd):
        copy_shards(photo_shards / "shards", d / "data" / "shards")
        write_params(d / "params.yaml", tree=photo_params(photo_shards / "photos"))
    r = run_stage("pretrain", ref, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"step {STEPS}/{STEPS}" in r.stderr

    # kill -9 once step 7 of 8 is logged: the checkpoint of step 6 (every 2 steps) is on disk,
    # two steps into the second epoch of 4 steps
    proc = subprocess.Popen(stage_cmd("pretrain"), cwd=wd, env=stage_env(None),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if f" step 7/{STEPS} " in line:
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
    assert not (wd / "models" / "encoder.pt").exists()
    assert checkpoint_file(wd).is_file()

    r = run_stage("pretrain", wd, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stderr and " at step 6" in r.stderr, r.stderr[-3000:]
    assert same_tensors(load_state(wd / "models/encoder.pt"), load_state(ref / "models/encoder.pt"))
