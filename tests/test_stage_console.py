"""What the stages print: counts that mean "unchanged" say so (``index_shards``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from helpers import TINY, load_script
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def _stage_module(name: str):
    return load_script(f"stages/{name}.py")


def test_index_summary__unchanged_said__counts_with_thousands_nothing_named():
    summary = _stage_module("index_shards").index_summary
    assert summary({"data.pretrain_shards": (3, 1200, 1, True)},
                   {"data.unlabelled_root": (302, 2, False)}) == [
        "data.pretrain_shards: unchanged (3 shards, 1,200 images, 1 broken skipped)",
        "data.unlabelled_root: listed (302 images, 2 broken skipped)"]
    assert summary({"data.pretrain_shards": (3, 119, 0, False)}, {}) == [
        "data.pretrain_shards: indexed (3 shards, 119 images)"]
    (line,) = summary({}, {})
    assert line.startswith("nothing to index") and '"images": 0' not in line


def _index_shards(wd: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "MLFLOW_TRACKING_URI": "sqlite:////nonexistent-dir/x.db"}
    r = subprocess.run([sys.executable, str(ROOT / "stages/index_shards.py"), "--params",
                        "params.yaml"], cwd=wd, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [ln for ln in r.stderr.splitlines() if ln.startswith("index_shards: ")]


def test_index_shards_stage__a_folder_listed_then_unchanged_then_listed_again(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    for i in range(5):
        Image.fromarray(rng.integers(0, 255, (20, 20), dtype=np.uint8), "L").save(
            photos / f"im{i}.png")
    tree = json.loads(json.dumps(TINY))
    tree["data"] = {"unlabelled_root": str(photos)}
    tree["mlflow"] = {"enabled": False}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tree))
    assert _index_shards(tmp_path) == [
        "index_shards: data.unlabelled_root: listed (5 images)"]
    # the next `dvc repro` (the stage is always_changed): nothing new, and it says so
    assert _index_shards(tmp_path) == [
        "index_shards: data.unlabelled_root: unchanged (5 images)"]
    Image.fromarray(np.zeros((20, 20), np.uint8), "L").save(photos / "new.png")
    assert _index_shards(tmp_path) == ["index_shards: data.unlabelled_root: listed (6 images)"]
