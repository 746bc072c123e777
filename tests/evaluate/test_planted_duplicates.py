"""Planted near-duplicates among real Fashion-MNIST images, found by the data_insights stage.

2,000 real train images and copies of 60 others (``benchmarks/near_duplicates.py``'s
``plant_duplicates``): 20 exact, 20 JPEG-re-encoded (quality 75-90) and 20 perturbed (resized
down by 4-14 % and back up, then JPEG 75-90); a short MoCo pretraining on them (width 8, 3
epochs), then the stage's own function at the default ``insights.duplicate_cosine``. The
measured numbers are in the assertions' comments; the default encoder's on all 60,000 images
in results/near-duplicates-2026-12-06.md (there too, resized 28 px copies are no closer to
their source than Fashion-MNIST's own lookalikes: the threshold does not catch them).
"""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import load_script, run_pretrain

from pipeline.config import InsightsParams, from_dict
from pipeline.data.build import write_shards
from pipeline.data.sources import Sample
from pipeline.data.sources.idx import FASHION_MNIST_CLASSES, FashionMnistSource, read_idx
from pipeline.evaluate.run.data_insights import data_insights

FMNIST = Path("/usr/share/datasets/fashion-mnist")
pytestmark = pytest.mark.skipif(not (FMNIST / "train-images-idx3-ubyte.gz").is_file(),
                                reason="Fashion-MNIST not installed (make setup)")


def _benchmark():
    return load_script("benchmarks/near_duplicates.py")


def _write(split_dir: Path, images, keys, labels) -> None:
    write_shards([Sample(k, im, int(y)) for k, im, y in zip(keys, images, labels)], split_dir,
                 split=split_dir.name, source="fashion_mnist", class_names=FASHION_MNIST_CLASSES,
                 mode="L", samples_per_shard=1000, mean=FashionMnistSource.mean,
                 std=FashionMnistSource.std, progress=False)


def test_planted_duplicates__found_at_the_default_threshold(tmp_path):
    bench = _benchmark()
    pixels = read_idx(FMNIST / "train-images-idx3-ubyte.gz", 3)
    labels = read_idx(FMNIST / "train-labels-idx1-ubyte.gz", 1)
    images, keys, planted = bench.plant_duplicates(pixels[:2000], exact=20, perturbed=20,
                                                   jpeg_only=20)
    shards = tmp_path / "shards"
    _write(shards / "pretrain", images, keys, [-1] * len(keys))
    for split, rows in (("train", range(2000, 2500)), ("test", range(2500, 2700))):
        _write(shards / split, [bench.Image.fromarray(pixels[i]) for i in rows],
               [f"{split}{i:05d}" for i in rows], labels[list(rows)])
    run_pretrain(shards, tmp_path / "out", {
        "model": {"width": 8, "head_hidden": 64, "dim": 32}, "moco": {"K": 512},
        "pretrain": {"epochs": 3, "batch_size": 64},
        "embed": {"pool_grid": 1, "layer": 4}})
    params = from_dict({"embed": {"pool_grid": 1, "layer": 4}, "insights": {"listed": 100000}})
    m = data_insights(encoder_path=tmp_path / "out/encoder.pt", head_path=None,
                      shards_dir=shards, index_dir=None, image_size=0, embed=params.embed,
                      insights=params.insights, features_dir=tmp_path / "features",
                      details_path=tmp_path / "eval/data_insights.json",
                      neighbourhoods_path=tmp_path / "features/insights.pt")
    assert params.insights.duplicate_cosine == InsightsParams().duplicate_cosine  # the default
    details = json.loads((tmp_path / "eval/data_insights.json").read_text())
    assert m["images"] == 2060 and len(details["pairs"]) == m["duplicate_pairs"]
    pairs = [(p["a"]["key"], p["b"]["key"]) for p in details["pairs"]]
    got = bench.planted_recall(pairs, planted)
    print(json.dumps(got))  # the measured numbers, with -s
    assert got["found_exact"] == 20  # same pixels, same features: cosine 1
    assert got["found_jpeg"] >= 15  # measured: 17 of 20 (2026-12-06, one thread)
    assert got["found_perturbed"] >= 0  # measured: 1 of 20. At 28 px a resize moves the
    # features as far as a lookalike item does (results file, default encoder: 0.5 % at 0.998)
    # The pairs found that were not planted ("false positives", measured: 16 on an AMD EPYC, 46
    # on an Intel Xeon with AMX, whose bf16 training gives another encoder) are lookalikes in
    # pixels too: every one differs by less than half the mean absolute difference of random
    # pairs of the same images (measured: at most 24 grey levels of 255, random pairs ~71).
    planted_pairs = {tuple(sorted(p)) for p in planted}
    extra = [p for p in pairs if tuple(sorted(p)) not in planted_pairs]
    assert len(extra) == got["not_planted"] <= 60
    grey = {k: np.asarray(im, dtype=np.float32) for k, im in zip(keys, images)}
    rng = np.random.default_rng(0)
    rand = [np.abs(grey[keys[i]] - grey[keys[j]]).mean()
            for i, j in rng.integers(0, 2000, size=(500, 2)) if i != j]
    assert all(np.abs(grey[a] - grey[b]).mean() < 0.5 * np.median(rand) for a, b in extra)
