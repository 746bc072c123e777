"""Bad params: every stage script refuses them before any work (exit 2, one stderr line naming
the key, nothing created), and the trainer refuses more ranks than the batch can feed."""

from __future__ import annotations

import pytest
import torch
from helpers import run_pretrain
from relhelpers import copy_shards, run_stage, write_params

import pipeline.train.engine as train_mod

# Two stage processes prove the wiring (a stage refuses before any work, one line naming the
# key, exit 2, nothing created); which values are refused is the unit table of
# tests/test_config.py (test_from_dict__error_names_the_key), which holds every rule.
CASES = [  # (stage, section, key, bad value)
    ("pretrain", "moco", "m", 1.5),
    ("build_shards", "data", "source", "mnist"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "section", "key", "value"), CASES,
                         ids=[f"{c[0]}-{c[1]}.{c[2]}={c[3]}" for c in CASES])
def test_stage__bad_param__exit_2_one_line_naming_key_nothing_written(stage, section, key,
                                                                     value, tmp_path):
    wd = tmp_path / "wd"
    write_params(wd / "bad.yaml", {section: {key: value}}, mlflow=True)
    db = tmp_path / "x.db"

    r = run_stage(stage, wd, "bad.yaml", db=db, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"'{section}.{key}'" in lines[0] and lines[0].startswith("error: ")
    assert r.stdout == ""
    assert sorted(p.name for p in wd.iterdir()) == ["bad.yaml"]  # no models/, runs/, data/
    assert not db.exists()


def test_pretrain_stage__missing_params_file__exit_2_naming_it(tmp_path):
    r = run_stage("pretrain", tmp_path, "nope.yaml", db=tmp_path / "x.db", timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: nope.yaml: file does not exist"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("world_size", [17, 32, 48])
def test_pretrain__more_ranks_than_batch__refused_before_any_output(world_size, tiny_shards,
                                                                   tmp_path, monkeypatch):
    # torchrun-free: the trainer sees the Runtime a WORLD_SIZE=N launch would give rank 0
    monkeypatch.setattr(train_mod, "setup_device", lambda: train_mod.Runtime(
        device=torch.device("cpu"), rank=0, world_size=world_size, local_rank=0))
    with pytest.raises(ValueError, match=rf"batch_size \(16\).*processes \({world_size}\)"):
        run_pretrain(tiny_shards, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_pretrain__one_image_per_rank_with_split_bn__refused(tiny_shards, tmp_path,
                                                             monkeypatch):
    # batch 16 over 16 ranks = 1 image per rank: 2 BN splits cannot divide it
    monkeypatch.setattr(train_mod, "setup_device", lambda: train_mod.Runtime(
        device=torch.device("cpu"), rank=0, world_size=16, local_rank=0))
    with pytest.raises(ValueError, match="bn_splits"):
        run_pretrain(tiny_shards, tmp_path)
    assert list(tmp_path.iterdir()) == []


def _imagefolder_grid_run(tiny_shards, tmp_path, stem_stride: int):
    wd = tmp_path / "wd"
    shards = copy_shards(tiny_shards, wd / "shards")
    # imagefolder at image_size 0: only the manifest knows the side (16 px here)
    write_params(wd / "params.yaml", {
        "data": {"source": "imagefolder", "root": str(tmp_path / "images"), "image_size": 0,
                 "shards_dir": str(shards)},
        "model": {"stem_stride": stem_stride},
        "embed": {"layer": 4, "pool_grid": 2}}, mlflow=False)
    return wd, run_stage("pretrain", wd, db=tmp_path / "x.db", timeout=300)


def test_pretrain__grid_larger_than_the_manifests_map__exit_2_before_training(tiny_shards,
                                                                            tmp_path):
    # 16 px, stride-2 small stem: 16 -> 8 -> 4 -> 2 -> 1, a 1 x 1 map, so grid 2 cannot fit
    wd, r = _imagefolder_grid_run(tiny_shards, tmp_path, stem_stride=2)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: params.yaml: 'embed.pool_grid' = 2 is invalid")
    assert "<= 1: 16 px images" in lines[0] and "pretrain/manifest.json" in lines[0]
    assert sorted(p.name for p in wd.iterdir()) == ["params.yaml", "shards"]  # nothing written


def test_pretrain__grid_that_fits_the_manifests_map__trains(tiny_shards, tmp_path):
    # stride 1: 16 -> 16 -> 8 -> 4 -> 2, a 2 x 2 map: grid 2 fits and pretraining runs
    wd, r = _imagefolder_grid_run(tiny_shards, tmp_path, stem_stride=1)
    assert r.returncode == 0, r.stderr
    assert (wd / "models" / "encoder.pt").is_file()
