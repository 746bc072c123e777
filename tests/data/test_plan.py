"""The pretraining set before build_shards: its size (against moco.K) and its mode, by hand."""

from __future__ import annotations

import io
import tarfile
from dataclasses import replace

import pytest
from helpers import img2dataset_shards

from pipeline.config import from_dict
from pipeline.data.index import empty_manifest, index_shards
from pipeline.data.manifest import ShardEntry
from pipeline.data.plan import plan_pretraining


def _folder(root, images, mode, broken=(), **more):
    return {"root": root, "images": images, "mode": mode, "bytes": 0, "skipped": {},
            "listing_sha256": "", **({"broken": list(broken)} if broken else {}), **more}


def _ext(n, mode="RGB", shards=2):
    entry = ShardEntry(url="s", num_samples=n // shards, bytes=0, sha256="")
    return replace(empty_manifest("pretrain"), num_samples=n, mode=mode,
                   shards=(entry,) * shards if n else ())


EMPTY = {"pretrain": _ext(0), "labelled": _ext(0)}


@pytest.mark.parametrize(("data", "folders", "manifests", "want"), [
    # 3 photos and no labelled images: N = 3, the photos decide the mode
    ({"source": "none", "unlabelled_root": "/p"},
     {"data.unlabelled_root": _folder("/p", 3, "RGB")}, EMPTY,
     (3, "3 in data.unlabelled_root /p", "RGB", "data.unlabelled_root /p")),
    # the labelled part left out (pretrain_labelled false), 1 of 4 photos broken; the grey
    # evaluation images and RGB photos make RGB
    ({"source": "imagefolder", "root": "/l", "unlabelled_root": "/p",
      "pretrain_labelled": False},
     {"data.root": _folder("/l", 60, "L", train_images=40),
      "data.unlabelled_root": _folder("/p", 4, "RGB", broken=["x.jpg"])}, EMPTY,
     (3, "3 in data.unlabelled_root /p (1 broken left out)", "RGB",
      "data.source imagefolder, data.root /l and data.unlabelled_root /p")),
    # Fashion-MNIST's 60,000 + a grey tree, capped at 1000, + 200 in shards read in place: the
    # RGB shards take the evaluation data's mode, L
    ({"unlabelled_root": "/p", "max_pretrain_images": 1000, "pretrain_shards": "/s"},
     {"data.unlabelled_root": _folder("/p", 50, "L")},
     {"pretrain": _ext(200, "RGB", 4), "labelled": _ext(0)},
     (1200, "data.max_pretrain_images 1000 of 60000 of data.source fashion_mnist + 50 in "
      "data.unlabelled_root /p + 200 in data.pretrain_shards (4 shards)", "L",
      "data.source fashion_mnist and data.unlabelled_root /p")),
    # shards alone: their own mode
    ({"source": "none", "pretrain_shards": "/s"}, {}, {"pretrain": _ext(30, "L", 1),
                                                       "labelled": _ext(0)},
     (30, "30 in data.pretrain_shards (1 shards)", "L",
      "data.pretrain_shards, no labelled or folder images")),
])
def test_plan_pretraining__images_and_mode_by_hand(data, folders, manifests, want):
    p = from_dict({"data": data, "moco": {"K": 2}, "pretrain": {"batch_size": 2}})
    plan = plan_pretraining(p.data, folders=folders, manifests=manifests)
    assert (plan.images, plan.images_from, plan.mode, plan.mode_from) == want


def test_plan_pretraining__webdataset_train_split_and_unlabelled(tmp_path):
    # 10 samples of 4 classes (i % 4: 3, 3, 2, 2) via .cls, 2 without: at test_fraction 0.25
    # int(3 x 0.25 + 0.5) = 1 and int(2 x 0.25 + 0.5) = 1 test each, so train 10 - 4 = 6,
    # pretrain = train + the 2 unlabelled = 8; grey images: mode L
    (path,) = img2dataset_shards(tmp_path / "lab", shards=1, per_shard=12, cls=(0,),
                                 colour=False)
    with tarfile.open(path) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    with tarfile.open(path, "w") as t:
        for m, data in members:
            if m.name not in ("000000010.cls", "000000011.cls"):
                t.addfile(m, io.BytesIO(data))
    m, _ = index_shards(str(path.parent), split="labelled", key="data.root",
                        max_broken_fraction=0, label_field="cls")
    p = from_dict({"data": {"source": "webdataset", "root": str(path.parent),
                            "test_fraction": 0.25}})
    plan = plan_pretraining(p.data, folders={}, manifests={"pretrain": _ext(0), "labelled": m})
    assert (plan.images, plan.mode) == (8, "L")
    assert plan.images_from == f"8 of data.source webdataset, data.root {path.parent}"
