"""The real-data recipe at tiny scale: Fashion-MNIST's train images as an unlabelled PNG tree.

``benchmarks/fmnist_unlabelled_tree.py --limit 600`` writes the first 600 train images as PNGs
without labels or class folders; ``configs/fashion-mnist-unlabelled.yaml`` (shrunk: tiny model,
one epoch, 300 labelled train and 200 test images) runs end to end under `dvc repro`: the
pretrain shards hold exactly the 600 tree images with label -1 in the source's normalisation,
and the evaluation uses the capped labelled splits.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from repohelpers import ROOT, TINY, make_repo, out, ran, sh

from pipeline.data.shards import read_manifest
from pipeline.data.sources import FASHION_MNIST_CLASSES

FMNIST = "/usr/share/datasets/fashion-mnist"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(f"{FMNIST}/train-images-idx3-ubyte.gz").exists(),
                                 reason="Fashion-MNIST not installed (apt-get install "
                                 "dataset-fashion-mnist; `make setup` does)")]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    dst = tmp_path_factory.mktemp("fmnist") / "tree"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/fmnist_unlabelled_tree.py"),
                          "--out", str(dst), "--limit", "600"], capture_output=True, text=True,
                         timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    return dst, json.loads(res.stdout)


def test_tree__first_600_train_images_no_labels_anywhere(tree):
    dst, summary = tree
    assert (summary["images"], summary["folders"]) == (600, 1)
    files = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file())
    assert files == [f"000/{i:05d}.png" for i in range(600)]
    with gzip.open(f"{FMNIST}/train-images-idx3-ubyte.gz") as f:
        raw = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    for i in (0, 1, 599):
        im = Image.open(dst / f"000/{i:05d}.png")
        assert im.mode == "L" and np.array_equal(np.asarray(im), raw[i])
    assert not any(c.lower() in "/".join(files).lower() for c in FASHION_MNIST_CLASSES)


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tree):
    treedir, _ = tree
    preset = yaml.safe_load((ROOT / "configs/fashion-mnist-unlabelled.yaml").read_text())
    small = {"data": {"unlabelled_root": str(treedir), "max_train_images": 300,
                      "max_test_images": 200, "samples_per_shard": 256},
             **{k: v for k, v in TINY.items() if k not in ("data", "embed")},
             "knn": {"select": "fixed", "k": 10}}
    for sec, vals in small.items():
        preset[sec].update(vals)
    dst = tmp_path_factory.mktemp("fmnist-repo") / "repo"
    env = make_repo(dst, preset)
    return dst, out(sh(["dvc", "repro"], dst, env)), env


def test_fmnist_preset__repro_end_to_end_on_the_tree(repo):
    dst, text, _ = repo
    assert ran(text) == ["check_params", "index_shards", "build_shards", "check_data", "pretrain",
                         "data_insights", "check_eval", "embed", "baselines", "knn", "linear",
                         "label_efficiency", "select_labels", "report"]
    pre = read_manifest(dst / "data/shards/pretrain")
    train = read_manifest(dst / "data/shards/train")
    assert pre.num_samples == 600 and pre.label_counts == {"-1": 600}
    assert pre.image_shape == (1, 28, 28) and pre.mode == "L"
    assert pre.mean == train.mean == (0.286,)  # the source's published statistics
    assert pre.build["unlabelled"]["images"] == 600
    embed = json.loads((dst / "eval/metrics/embed.json").read_text())
    assert (embed["train_images"], embed["test_images"]) == (300, 200)
    assert json.loads((dst / "eval/metrics/pretrain.json").read_text())["pretrain_images"] == 600


def test_no_labels_preset__its_data_stages_on_the_tree_find_no_labels(repo):
    # configs/fashion-mnist-no-labels.yaml (shrunk alike) on the same tree: no labelled split,
    # so check_eval says unlabelled (the evaluation stages then skip: a whole no-labels
    # `dvc repro` down to the report is tests/e2e/test_own_folders.py's recipe 3)
    dst, _, env = repo
    preset = yaml.safe_load((ROOT / "configs/fashion-mnist-no-labels.yaml").read_text())
    kept = yaml.safe_load((dst / "params.yaml").read_text())
    for sec in ("model", "moco", "pretrain", "linear", "report", "knn"):
        preset[sec] = kept[sec]
    preset["data"].update(unlabelled_root=kept["data"]["unlabelled_root"],
                          samples_per_shard=kept["data"]["samples_per_shard"])
    (dst / "params.yaml").write_text(yaml.safe_dump(preset, sort_keys=False))
    text = out(sh(["dvc", "repro", "check_eval"], dst, env))
    assert "error:" not in text and "Traceback" not in text, text[-3000:]
    assert {"check_params", "index_shards", "build_shards", "check_eval"} <= set(ran(text))
    assert "pretrain" not in ran(text)  # check_eval reads the manifests alone
    assert read_manifest(dst / "data/shards/train").num_samples == 0
    assert read_manifest(dst / "data/shards/test").num_samples == 0
    pre = read_manifest(dst / "data/shards/pretrain")
    assert pre.num_samples == 600 and pre.label_counts == {"-1": 600}
    assert json.loads((dst / "runs/check_eval.json").read_text())["labelled"] is False
    again = out(sh(["dvc", "repro", "check_eval"], dst, env))
    assert ran(again) == ["index_shards"], again[-3000:]  # the same tree: nothing rebuilt
