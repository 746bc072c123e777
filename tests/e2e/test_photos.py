"""Real photos end to end: a labelled photo folder + an unlabelled photo tree, `dvc repro`.

360 real-photo JPEG crops (320 x 240, quality 90) of scikit-learn's two sample photographs
(``benchmarks/sample_photos.py``): 240 in an ImageFolder whose 4 classes are the source photo
and the half it was cut from, 120 in a tree without classes. Whole images (``data.max_side``
320: no resize, so every JPEG keeps its bytes), 64 px views (RandomResizedCrop per image in the
loader workers, JPEG draft where the boxes allow), RGB, ``augment.preset: v2``. Every stage
runs; the shards hold the files' own bytes; a second `dvc repro` reruns nothing but the index.
"""

from __future__ import annotations

import hashlib
import json
import math
import tarfile

import pytest
from helpers import write_photos
from repohelpers import STAGES, commit, make_repo, out, params, ran, sh

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    base = tmp_path_factory.mktemp("photos")
    write_photos(base / "labelled", count=240, width=320, height=240)
    write_photos(base / "tree", count=120, width=320, height=240, seed=1, labelled=False)
    tree = params({
        "data": {"source": "imagefolder", "root": str(base / "labelled"),
                 "unlabelled_root": str(base / "tree"), "image_size": 64, "max_side": 320,
                 "shard_format": "auto"},
        "augment": {"preset": "v2", "crop_min_scale": 0.2},
        "pretrain": {"num_workers": 1},
        "label_efficiency": {"per_class": [1, 5], "draws": 2},
    })
    dst = base / "repo"
    env = make_repo(dst, tree)
    first = sh(["dvc", "repro"], dst, env, timeout=1500)
    commit(dst, env)
    return base, dst, env, out(first)


def test_photos__repro_runs_every_stage(repo):
    *_, text = repo
    assert ran(text) == STAGES


def test_photos__shards_keep_every_jpeg_byte_for_byte(repo):
    base, dst, _, _ = repo
    sources = {p.read_bytes() for p in base.rglob("*.jpg")}
    assert len(sources) == 360
    stored = []
    for split in ("pretrain", "test"):
        m = json.loads((dst / "data/shards" / split / "manifest.json").read_text())
        assert m["mode"] == "RGB" and m["build"]["shard_format"] == "auto"
        assert m["build"]["members"] == {"jpg_copied": m["num_samples"], "jpg_encoded": 0,
                                         "png": 0}
        for s in m["shards"]:
            with tarfile.open(dst / "data/shards" / split / s["name"]) as t:
                stored += [t.extractfile(x).read() for x in t.getmembers()
                           if x.name.endswith(".jpg")]
    # pretrain = the 120 tree photos + the labelled train photos; test = the rest: all 360
    assert len(stored) == 360 and set(stored) == sources


def test_photos__metrics_are_numbers(repo):
    _, dst, _, _ = repo
    pre = json.loads((dst / "eval/metrics/pretrain.json").read_text())
    knn = json.loads((dst / "eval/metrics/knn.json").read_text())
    assert pre["pretrain_images"] == 120 + 192  # 240 labelled, 48 held out for test (0.2)
    assert all(math.isfinite(v) for v in pre.values())
    top1 = next(v for k, v in knn.items() if "top1" in k)
    assert 0 <= top1 <= 100


def test_photos__second_repro_reruns_nothing_but_the_index(repo):
    _, dst, env, _ = repo
    again = ran(out(sh(["dvc", "repro"], dst, env, timeout=600)))
    assert "index_shards" in again and set(again) <= {"check_params", "index_shards"}, again


def test_photos__a_new_crop_side_retrains_a_new_encoder(repo):
    # whole-image shards (data.max_side): data.image_size is the training crop only, the shard
    # bytes stay; the training input's image spec changes, so the finished checkpoint of the
    # 64 px training is not resumed and the encoder is trained again at 48 px
    _, dst, env, _ = repo
    before = hashlib.sha256((dst / "models/encoder.pt").read_bytes()).hexdigest()
    text = (dst / "params.yaml").read_text()
    assert "image_size: 64" in text
    (dst / "params.yaml").write_text(text.replace("image_size: 64", "image_size: 48", 1))
    log = out(sh(["dvc", "repro", "pretrain"], dst, env, timeout=1200))
    assert "is a finished training of this fingerprint" not in log
    assert json.loads((dst / "models/encoder.json").read_text())["image_size"] == 48
    assert hashlib.sha256((dst / "models/encoder.pt").read_bytes()).hexdigest() != before
