"""The data_insights stage body on tiny shards: outputs, shards read in place, reuse by embed."""

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import TINY, build_tiny_shards, img2dataset_shards, make_samples, run_pretrain
from PIL import Image

from pipeline.config import from_dict
from pipeline.data.build import empty_split, write_shards
from pipeline.data.index import index_shards
from pipeline.data.manifest import write_manifest
from pipeline.data.shards import ShardError
from pipeline.data.sources import Sample
from pipeline.evaluate.features import load_features
from pipeline.evaluate.insights import load_neighbourhoods
from pipeline.evaluate.run.data_insights import data_insights
from pipeline.evaluate.run.embed import embed

ROOT = Path(__file__).resolve().parents[2]
TINY_EMBED = from_dict(json.loads(json.dumps(TINY))).embed  # layer 3, global pool


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """A tiny pretrained encoder (16 px grey, width 4): ``.../encoder.pt``."""
    root = tmp_path_factory.mktemp("enc")
    run_pretrain(build_tiny_shards(root / "shards"), root / "out")
    return root / "out" / "encoder.pt"


def _run(encoder, shards, out, index_dir=None, **insights):
    params = from_dict({**json.loads(json.dumps(TINY)), "insights": insights})
    return data_insights(encoder_path=encoder, head_path=None, shards_dir=shards,
                         index_dir=index_dir, image_size=0, embed=params.embed,
                         insights=params.insights, features_dir=out / "features",
                         details_path=out / "eval/data_insights.json",
                         neighbourhoods_path=out / "features/insights.pt")


def test_data_insights__train_split_same_shards__embed_reuses_the_features(encoder, tmp_path):
    shards = build_tiny_shards(tmp_path / "shards", n_pretrain=96, n_train=96)
    shutil.rmtree(shards / "pretrain")
    shutil.copytree(shards / "train", shards / "pretrain")  # the default run's layout
    m = _run(encoder, shards, tmp_path, neighbours=3, listed=5)
    assert m["features_for_embed"] == 1 and m["images"] == 96
    assert not (tmp_path / "features/.pretrain.rows").exists()  # made there, removed after
    details = json.loads((tmp_path / "eval/data_insights.json").read_text())
    assert details["images"] == 96 and details["parts"] == {"built": 96, "read_in_place": 0}
    assert len(details["outliers"]) == 5 and len(details["pairs"]) <= 5
    assert all(o["shard"].startswith(str(shards / "pretrain" / "shard-")) for o in
               details["outliers"])
    # what select_labels picks from: every image, its score and shard, as the details list them
    nb = load_neighbourhoods(tmp_path / "features/insights.pt")
    assert nb["built_is_train"] and nb["built"] == 96 and nb["features"].shape[0] == 96
    top = max(range(96), key=lambda r: float(nb["outlier_score"][r]))
    assert (nb["keys"][top], nb["where"][top]) == (details["outliers"][0]["key"],
                                                   details["outliers"][0]["shard"])
    assert float(nb["outlier_score"][top]) == pytest.approx(details["outliers"][0]["score"],
                                                            abs=1e-3)
    assert nb["pairs"].shape[1] == 2 and len(nb["pairs"]) == details["duplicate_pairs"]
    same = {"layer": TINY_EMBED.layer, "pool_grid": TINY_EMBED.pool_grid}  # as data_insights
    reused = embed(encoder_path=encoder, shards_dir=shards, out_dir=tmp_path / "a",
                   batch_size=32, reuse_dir=tmp_path / "features", **same)
    fresh = embed(encoder_path=encoder, shards_dir=shards, out_dir=tmp_path / "b", batch_size=32,
                  **same)
    assert reused["train_reused"] == 1 and fresh["train_reused"] == 0
    for name in ("train", "train_global"):  # copied byte for byte: one DVC cache entry
        assert (tmp_path / "a" / f"{name}.pt").read_bytes() == (
            tmp_path / "features" / f"{name.replace('train', 'pretrain')}.pt").read_bytes()
    assert "train_images_per_s" not in reused
    for name in ("train", "train_global", "test"):
        a, b = (load_features(tmp_path / d / f"{name}.pt") for d in "ab")
        assert a.keys == b.keys and torch.equal(a.labels, b.labels)
        torch.testing.assert_close(a.features, b.features, atol=1e-5, rtol=0)
    # other embed params than data_insights used: its features are checked and not reused
    other = embed(encoder_path=encoder, shards_dir=shards, out_dir=tmp_path / "c",
                  batch_size=32, reuse_dir=tmp_path / "features", layer=4, pool_grid=1)
    assert other["train_reused"] == 0 and other["dim"] == 32 != reused["dim"] == 16


def test_data_insights__other_shards__features_left_empty(encoder, tmp_path):
    shards = build_tiny_shards(tmp_path / "shards", n_pretrain=64)
    m = _run(encoder, shards, tmp_path)
    assert m["features_for_embed"] == 0 and m["images"] == 64 and m["k"] == 10
    assert len(load_features(tmp_path / "features/pretrain.pt")) == 0
    assert not load_neighbourhoods(tmp_path / "features/insights.pt")["built_is_train"]
    out = embed(encoder_path=encoder, shards_dir=shards, out_dir=tmp_path / "e", batch_size=32,
                reuse_dir=tmp_path / "features")
    assert out["train_reused"] == 0 and out["train_images"] == 96


def _jpeg_decoded(image):
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return Image.open(io.BytesIO(buf.getvalue())).convert("L")


def test_data_insights__pretrain_shards_read_in_place(encoder, tmp_path):
    # Shard 00000 read in place holds the JPEGs of make_samples(20, seed=0) (img2dataset
    # layout, grey, one cut short). The built pretrain split holds the same 20 images decoded
    # from those JPEGs: the same pixels, so each pair has cosine 1 up to float rounding, and
    # the 19 decodable in-place samples are found as near-duplicates of their built twins.
    # Shard 00002 holds colour photos: read in the pretraining set's grey mode, as pretraining
    # reads them.
    shards = build_tiny_shards(tmp_path / "shards")
    twins = [Sample(f"b{i:04d}", _jpeg_decoded(s.image), -1)
             for i, s in enumerate(make_samples(20, seed=0))]
    shutil.rmtree(shards / "pretrain")
    write_shards(twins, shards / "pretrain", split="pretrain", source="synthetic",
                 class_names=["a", "b", "c", "d"], mode="L", samples_per_shard=64,
                 progress=False)
    img2dataset_shards(tmp_path / "ext", shards=2, per_shard=20, colour=False, broken={0: 1})
    img2dataset_shards(tmp_path / "ext", shards=1, per_shard=20, start=2, colour=True)
    manifest, _ = index_shards(str(tmp_path / "ext"), split="pretrain",
                               key="data.pretrain_shards", max_broken_fraction=0.1)
    write_manifest(manifest, tmp_path / "index")
    m = _run(encoder, shards, tmp_path, index_dir=tmp_path / "index", duplicate_cosine=0.9999,
             listed=100)
    d = json.loads((tmp_path / "eval/data_insights.json").read_text())
    assert m["images"] == 20 + 59 and d["parts"] == {"built": 20, "read_in_place": 59}
    ext0 = str(tmp_path / "ext/00000.tar")
    found = {(p["a"]["key"], p["b"]["key"]): (p["a"]["shard"], p["b"]["shard"])
             for p in d["pairs"]}
    for i in range(1, 20):  # sample 0 of shard 00000 is the broken one, skipped
        assert found[(f"b{i:04d}", f"00000{i:04d}")] == (
            str(shards / "pretrain/shard-000000.tar"), ext0)
    assert all(p["cosine"] >= 0.9999 for p in d["pairs"])
    assert m["features_for_embed"] == 0


def test_data_insights__planted_blank_and_noise_images_listed_first(encoder, tmp_path):
    # 94 images of make_samples (a bright quadrant over mild noise: neighbouring pixels
    # correlate through the quadrant edge) plus a constant grey image and uniform pixel noise,
    # at rows 30 and 70. The tiny encoder knows neither; their pixels give them away: the
    # constant image has spread 0 (near-constant, and all of it one flat level), the noise
    # a neighbour correlation ~0 where the others have ~0.8 (noise-like).
    shards = build_tiny_shards(tmp_path / "shards")
    shutil.rmtree(shards / "pretrain")
    samples = make_samples(94, seed=5)
    rng = np.random.default_rng(0)
    samples.insert(30, Sample("blank", Image.new("L", (16, 16), 128), -1))
    samples.insert(70, Sample("noise", Image.fromarray(
        rng.integers(0, 256, (16, 16), dtype=np.uint8), "L"), -1))
    write_shards(samples, shards / "pretrain", split="pretrain", source="synthetic",
                 class_names=["a", "b", "c", "d"], mode="L", samples_per_shard=64,
                 progress=False)
    _run(encoder, shards, tmp_path, neighbours=5, listed=96)
    d = json.loads((tmp_path / "eval/data_insights.json").read_text())
    assert d["views"] == ["embedding", "low_level", "near_constant", "noise_like", "flat_area"]
    first = {o["key"]: o for o in d["outliers"][:2]}
    print({k: o["views"] for k, o in first.items()})  # the measured z-scores, with -s
    assert sorted(first) == ["blank", "noise"]
    real = [o["views"] for o in d["outliers"] if o["key"] not in first]
    for key, view in (("blank", "near_constant"), ("noise", "noise_like")):
        assert first[key]["views"][view] > 2 * max(v[view] for v in real)
    assert all(o["score"] == max(o["views"].values()) for o in d["outliers"])
    scores = [o["score"] for o in d["outliers"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 96


def test_data_insights__no_pretraining_images(encoder, tmp_path):
    shards = build_tiny_shards(tmp_path / "shards")
    shutil.rmtree(shards / "pretrain")
    empty_split(shards / "pretrain", split="pretrain", source="none", class_names=[], mode="L",
                build={})
    with pytest.raises(ShardError, match="no pretraining images"):
        _run(encoder, shards, tmp_path)
    assert not (tmp_path / "eval").exists()


def test_stages__data_insights_then_embed_reuse_its_features(encoder, tmp_path):
    # the stage scripts as DVC runs them: data_insights writes the train split's features in the
    # default layout (pretrain split = train split), the embed stage copies them
    shards = build_tiny_shards(tmp_path / "data/shards", n_pretrain=64, n_train=64, n_test=32)
    shutil.rmtree(shards / "pretrain")
    shutil.copytree(shards / "train", shards / "pretrain")
    shutil.copytree(encoder.parent, tmp_path / "models", ignore=shutil.ignore_patterns("ckpt"))
    tree = {**json.loads(json.dumps(TINY)), "mlflow": {"enabled": False}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tree))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for stage in ("data_insights", "embed"):
        r = subprocess.run([sys.executable, str(ROOT / f"stages/{stage}.py")], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    insights = json.loads((tmp_path / "eval/metrics/data_insights.json").read_text())
    assert insights["images"] == 64 and insights["features_for_embed"] == 1
    assert json.loads((tmp_path / "eval/metrics/embed.json").read_text())["train_reused"] == 1
    assert json.loads((tmp_path / "runs/data_insights.json").read_text())["run_id"] is None
    # another threshold, another process: the same feature bytes, so DVC reruns no embed
    before = (tmp_path / "features/pretrain.pt").read_bytes()
    tree["insights"] = {"duplicate_cosine": 0.9}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tree))
    r = subprocess.run([sys.executable, str(ROOT / "stages/data_insights.py")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "features/pretrain.pt").read_bytes() == before
    assert json.loads((tmp_path / "eval/metrics/data_insights.json").read_text())[
        "duplicate_cosine"] == 0.9
