"""Bad data at the stage level: the stage exits non-zero, names the broken file, and leaves the
previous outputs byte-identical."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
from helpers import relabel_first_sample
from PIL import Image
from relhelpers import (
    PY,
    leftover_temp_files,
    rewrite_manifest,
    run_stage,
    stage_env,
    tree_digest,
    write_params,
)

SHARD1 = "data/shards/pretrain/shard-000001.tar"


def truncate_mid_member(path):
    path.write_bytes(path.read_bytes()[:50_000])  # inside a member's data


def truncate_at_member_boundary(path):
    with tarfile.open(path) as t:
        cut = t.getmembers()[40].offset  # a header boundary: tar itself sees a clean end
    path.write_bytes(path.read_bytes()[:cut])


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[3000] ^= 0xFF
    path.write_bytes(bytes(data))


def seed_previous_outputs(wd):
    """Outputs of an earlier run that a failing stage must not touch."""
    (wd / "models").mkdir()
    (wd / "models/encoder.pt").write_bytes(b"previous encoder")
    (wd / "metrics").mkdir()
    (wd / "metrics/pretrain.json").write_text('{"loss": 1.0}\n')


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["truncated", "truncated_at_member_boundary", "missing_shard",
                                   "num_samples_edited", "label_altered_same_size"])
def test_pretrain_stage__bad_shards__fails_naming_file_outputs_intact(fault, workdir):
    shard = workdir / SHARD1
    if fault == "truncated":
        truncate_mid_member(shard)
        named = SHARD1
    elif fault == "truncated_at_member_boundary":
        truncate_at_member_boundary(shard)
        named = SHARD1
    elif fault == "label_altered_same_size":
        relabel_first_sample(shard)
        named = SHARD1
    elif fault == "missing_shard":
        shard.unlink()
        named = SHARD1
    else:
        mpath = workdir / "data/shards/pretrain/manifest.json"
        m = json.loads(mpath.read_text())
        m["num_samples"] += 1
        mpath.write_text(json.dumps(m))
        named = "data/shards/pretrain/manifest.json"
    seed_previous_outputs(workdir)
    before = tree_digest(workdir)

    r = run_stage("pretrain", workdir)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert named in last, r.stderr[-3000:]
    assert last.startswith("error: ") and "Traceback" not in r.stderr  # one clear line
    assert tree_digest(workdir) == before  # no checkpoint, no output touched
    assert leftover_temp_files(workdir) == []


def test_verify_shards__flipped_byte__exit_1_naming_shard(workdir):
    flip_byte(workdir / SHARD1)
    r = subprocess.run([PY, "-m", "pipeline", "verify-shards", "data/shards"], cwd=workdir,
                       env=stage_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert SHARD1 in r.stderr and "sha256" in r.stderr


def undecodable_shard(shard, key_index: int):
    """Replace the PNG bytes of one sample with garbage (tar and manifest stay consistent)."""
    with tarfile.open(shard) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    pngs = [m.name for m, _ in members if m.name.endswith(".png")]
    victim = pngs[key_index]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for m, data in members:
            if m.name == victim:
                data = b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 20
                m.size = len(data)
            t.addfile(m, io.BytesIO(data))
    shard.write_bytes(out.getvalue())
    return victim.rsplit(".", 1)[0]


@pytest.mark.slow
def test_embed_stage__undecodable_image__fails_naming_shard_and_key(workdir, reference_run):
    for f in ("encoder.pt", "encoder.json", "head.pt"):
        (workdir / "models").mkdir(exist_ok=True)
        shutil.copyfile(reference_run / "models" / f, workdir / "models" / f)
    (workdir / "features").mkdir()
    (workdir / "features/train.pt").write_bytes(b"previous train features")
    (workdir / "features/test.pt").write_bytes(b"previous test features")
    key = undecodable_shard(workdir / "data/shards/test/shard-000000.tar", 5)
    rewrite_manifest(workdir / "data/shards/test")
    before = tree_digest(workdir)

    r = run_stage("embed", workdir)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "data/shards/test/shard-000000.tar" in last and key in last, r.stderr[-3000:]
    assert "undecodable image" in last
    assert tree_digest(workdir) == before  # features/train.pt is not replaced either
    assert leftover_temp_files(workdir) == []


def png(path, value: int, size: int = 8):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size), value, np.uint8), "L").save(path)


def image_folder(root, *, classes=("cat", "dog"), per_class=6):
    for c in classes:
        for i in range(per_class):
            png(root / c / f"{i}.png", 10 * i + 3)
    return root


def folder_params(wd, root):
    write_params(wd / "params.yaml", {"data": {"source": "imagefolder", "root": str(root),
                                               "test_fraction": 0.5}}, mlflow=False)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["empty_class_folder", "unreadable_file",
                                   "fashion_mnist_root_missing"])
def test_build_shards_stage__bad_source__fails_naming_path_shards_intact(fault, workdir,
                                                                          tmp_path):
    root = image_folder(tmp_path / "images")
    if fault == "empty_class_folder":
        (root / "empty").mkdir()
        named = str(root / "empty")
        folder_params(workdir, root)
    elif fault == "unreadable_file":
        (root / "dog" / "3.png").write_bytes(b"not an image at all")
        named = str(root / "dog" / "3.png")
        folder_params(workdir, root)
    else:
        named = str(tmp_path / "no-such-dir")
        write_params(workdir / "params.yaml", {"data": {"source": "fashion_mnist",
                                                        "root": named}}, mlflow=False)
    before = tree_digest(workdir / "data")

    r = run_stage("build_shards", workdir)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert named in last, r.stderr[-3000:]
    assert tree_digest(workdir / "data") == before
    assert leftover_temp_files(workdir) == []
