"""Inputs of the report for tests: a tiny but complete run (every file the report reads)."""

import io
import json

import numpy as np
import torch
import webdataset as wds
from PIL import Image

from pipeline.data.manifest import Manifest, ShardEntry, write_manifest

CLASS_NAMES = ["shirt", "shoe", "bag"]
PRETRAIN = {
    "loss": 5.4321,
    "inst_top1": 41.5,
    "inst_top5": 70.25,
    "steps": 20,
    "epochs": 2,
    "images_per_s": 812.5,
    "data_wait_fraction": 0.125,
    "wall_time_s": 31.5,
    "peak_memory_bytes": 104857600,
    "world_size": 1,
    "knn_top1": 66.5,
    "knn_top5": 98.0,
    "rankme": 41.25,
    "alignment": 0.375,
    "uniformity": -2.5,
    "rankme_init": 12.5,
    "alignment_init": 0.125,
    "uniformity_init": -0.25,
    "knn_top1_init": 40.25,
}
KNN = {
    "top1": 71.23,
    "top5": 99.5,
    "k": 20,
    "T": 0.1,
    "num_train": 60,
    "num_test": 24,
    "wall_time_s": 0.5,
}
LINEAR = {
    "top1": 73.87,
    "top5": 100.0,
    "epochs": 5,
    "lr": 30.0,
    "lr_effective": 3.75,
    "batch_size": 32,
    "mode_augment": 0,
    "wall_time_s": 2.5,
}
BASELINES = {
    "raw_pixels_top1": 62.41,
    "raw_pixels_top5": 97.0,
    "raw_pixels_knn_tuned_top1": 66.1,
    "raw_pixels_knn_tuned_top5": 97.5,
    "raw_pixels_knn_tuned_k": 5,
    "raw_pixels_knn_tuned_T": 0.05,
    "raw_pixels_knn_tuned_val_top1": 65.0,
    "raw_pixels_linear_top1": 70.02,
    "raw_pixels_linear_top5": 99.0,
    "random_encoder_top1": 48.09,
    "random_encoder_top5": 90.5,
}
EMBED = {"images_per_s": 2000.0, "wall_time_s": 1.5}
DVC_LOCK = """\
schema: '2.0'
stages:
  build_shards:
    cmd: python stages/build_shards.py
    deps:
    - path: stages/build_shards.py
      hash: md5
      md5: 0123456789abcdef0123456789abcdef
    outs:
    - path: data/shards
      hash: md5
      md5: aaaabbbbccccddddeeeeffff00001111.dir
  pretrain:
    cmd: python stages/pretrain.py
    outs:
    - path: models/encoder.pt
      hash: md5
      md5: 99998888777766665555444433332222
  report:
    cmd: python stages/report.py
    outs:
    - path: reports
      hash: md5
      md5: 0000111122223333444455556666777f.dir
    - path: runs/report.json
      hash: md5
      md5: 0000111122223333444455556666777e
"""
# what the tiny run's pretraining recorded of its process (runs/pretrain.json "ran")
RAN = {"precision": "bf16", "num_threads": 3, "processes": 2, "device": "cuda",
       "finished_utc": "2026-12-01 08:09:10", "cpu": "Test CPU 9000, 3 of 8 cores",
       "gpu": "2 x Test GPU", "torch": "9.1.0", "torchvision": "0.99.0", "dvc": "3.0.0",
       "mlflow": "3.1.0"}
PARAMS = {
    "seed": 3,
    "knn": {"k": 20},
    "report": {"tsne_points": 40, "retrieval_queries": 3, "retrieval_neighbours": 4},
}


def image(key_index: int) -> Image.Image:
    """A 28x28 grey image whose pixels encode its index (to check decoding)."""
    arr = np.full((28, 28), 3 * key_index % 256, dtype=np.uint8)
    arr[10:18, 10:18] = 255 - 3 * key_index % 256
    return Image.fromarray(arr, mode="L")


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def write_shards(split_dir, keys, labels, per_shard, *, manifest):
    split_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    for s, start in enumerate(range(0, len(keys), per_shard)):
        name = f"shard-{s:06d}.tar"
        with wds.TarWriter(str(split_dir / name)) as sink:
            for i in range(start, min(start + per_shard, len(keys))):
                sink.write({"__key__": keys[i], "png": png(image(i)), "cls": int(labels[i])})
        shards.append(ShardEntry(name=name, num_samples=min(per_shard, len(keys) - start),
                                 bytes=(split_dir / name).stat().st_size, sha256="0" * 64))
    if manifest:
        write_manifest(Manifest(source="synthetic", split=split_dir.name,
                                num_samples=len(keys), mode="L",
                                class_names=tuple(CLASS_NAMES), mean=(0.5,), std=(0.25,),
                                image_shape=(1, 28, 28), shards=tuple(shards)), split_dir)


def _points(means, std):
    return {n: {"mean": m, "std": std, "min": m - std, "max": m + std}
            for n, m in zip(("1", "10"), means)}


# MoCo 60.5 vs raw pixels 40 at 10 labels per class (kNN), spreads 2 and 3: a margin of 20.5
LABEL_EFFICIENCY = {
    "draws": 3, "train_images": 60,
    "curve": {
        "moco": {"knn": _points([30.0, 60.5], 2.0), "linear": _points([35.0, 70.0], 2.0)},
        "raw_pixels": {"knn": _points([25.0, 40.0], 3.0),
                       "linear": _points([20.0, 45.0], 3.0)},
        "random_encoder": {"knn": _points([20.0, 30.0], 1.0),
                           "linear": _points([21.0, 33.0], 1.0)},
    },
}


PRETRAIN_SHARD = "data/shards/pretrain/shard-000000.tar"
IN_PLACE_SHARD = "https://example.org/shards/000000.tar"  # a URL: drawn as a missing tile


def _item(i, key=None, shard=PRETRAIN_SHARD):
    return {"row": i, "key": key or f"pre{i:05d}", "shard": shard}


# 30 pretraining images (pre00000..pre00029, image(i) pixels) in one shard: 3 pairs, 3 outliers
DATA_INSIGHTS = {
    "images": 31, "parts": {"built": 30, "read_in_place": 1}, "k": 5,
    "duplicate_cosine": 0.98, "duplicate_pairs": 3, "images_in_pairs": 6,
    "outlier_score": {"min": 0.125, "p01": 0.125, "median": 0.75, "max": 0.99},
    "pairs": [
        {"cosine": 1.0, "a": _item(0), "b": _item(7)},
        {"cosine": 0.9912, "a": _item(3), "b": _item(30, "000000123", IN_PLACE_SHARD)},
        {"cosine": 0.9875, "a": _item(12), "b": _item(21)},
    ],
    "outliers": [{**_item(11), "score": 0.125}, {**_item(29), "score": 0.25},
                 {**_item(4), "score": 0.375}],
}
DATA_INSIGHTS_METRICS = {"images": 31, "duplicate_pairs": 3, "images_in_pairs": 6,
                         "duplicate_cosine": 0.98, "k": 5, "wall_time_s": 4.0}


def features(n, seed):
    """(n, 8) features around 3 fixed class centres (shared by train and test), noise by seed."""
    centres = torch.randn(3, 8, generator=torch.Generator().manual_seed(123)) * 3
    labels = torch.arange(n) % 3
    feats = centres[labels] + torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return feats, labels


def make_run(root):
    """Every input of the report, tiny: 60 train / 24 test embeddings of 3 classes."""
    for name, obj in (
        ("pretrain", PRETRAIN),
        ("knn", KNN),
        ("linear", LINEAR),
        ("baselines", BASELINES),
        ("embed", EMBED),
        ("data_insights", DATA_INSIGHTS_METRICS),
    ):
        write_json(root / f"eval/metrics/{name}.json", obj)
    (root / "plots").mkdir()
    rows = [
        "step\tepoch\tloss\tlr\tm\tinst_top1\tinst_top5\tqueue_mean_age\t"
        "data_wait_fraction\timages_per_s"
    ]
    for s in range(1, 6):
        rows.append(
            f"{s * 4}\t{s // 3}\t{6 - s * 0.2}\t{0.06 / s}\t0.99\t{10 * s}\t{15 * s}\t"
            f"{'nan' if s == 1 else s * 1.5}\t0.1\t{800 + s}"
        )
    (root / "plots/pretrain.tsv").write_text("\n".join(rows) + "\n")
    (root / "plots/knn_monitor.tsv").write_text(
        "epoch\tstep\tknn_top1\tknn_top5\n0\t0\t40.25\t90\n1\t10\t55\t95\n2\t20\t66.5\t98\n"
    )
    (root / "plots/labelfree.tsv").write_text(
        "epoch\tstep\trankme\talignment\tuniformity\n0\t0\t12.5\t0.125\t-0.25\n"
        "1\t10\t30\t0.25\t-2\n2\t20\t41.25\t0.375\t-2.5\n"
    )
    write_json(root / "eval/metrics/label_efficiency.json", LABEL_EFFICIENCY)
    (root / "plots/linear.tsv").write_text(
        "epoch\tloss\ttrain_acc\tlr\n"
        + "".join(f"{e}\t{2 - e * 0.3}\t{50 + 5 * e}\t3.75\n" for e in range(1, 6))
    )
    (root / "plots/linear_val.tsv").write_text(
        "epoch\tval_acc\n" + "".join(f"{e}\t{48 + 5 * e}\n" for e in range(1, 6))
    )
    for stem, acc in (("knn", [70.0, 80.0, 63.7]), ("linear", [75.0, 77.5, 69.1])):
        write_json(
            root / f"eval/{stem}_details.json",
            {
                "class_names": CLASS_NAMES,
                "per_class_accuracy": acc,
                "confusion_matrix": [[6, 1, 1], [1, 6, 1], [2, 1, 5]],
            },
        )
    train_x, train_y = features(60, 0)
    test_x, test_y = features(24, 1)
    train_keys = [f"train{i:05d}" for i in range(60)]
    test_keys = [f"test{i:05d}" for i in range(24)]
    (root / "features").mkdir()
    torch.save(
        {"features": train_x, "labels": train_y, "keys": train_keys}, root / "features/train.pt"
    )
    torch.save({"features": test_x, "labels": test_y, "keys": test_keys}, root / "features/test.pt")
    write_shards(root / "data/shards/train", train_keys, train_y, 30, manifest=False)
    write_shards(root / "data/shards/test", test_keys, test_y, 24, manifest=True)
    write_shards(root / "data/shards/pretrain", [f"pre{i:05d}" for i in range(30)], [-1] * 30, 30,
                 manifest=False)
    write_json(root / "eval/data_insights.json", DATA_INSIGHTS)
    (root / "dvc.lock").write_text(DVC_LOCK)
    for i, stage in enumerate(("build_shards", "pretrain", "embed", "baselines", "knn", "linear")):
        write_json(
            root / f"runs/{stage}.json",
            {
                "stage": stage,
                "run_id": None if stage == "embed" else f"run{i:02d}abc",
                "tracking_uri": "https://alice:s3cret@mlflow.example.org",
                "experiment_id": "7",
                **({"ran": RAN} if stage == "pretrain" else {}),
            },
        )
    return root


def md_section(md, title):
    """The Markdown of one ``## title`` section."""
    return md.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def md_row(md, first_cell, second_cell_starts=""):
    """The cells of the one Markdown table row whose first cell is ``first_cell`` (and whose
    second cell starts with ``second_cell_starts``)."""
    rows = [ln for ln in md.splitlines()
            if ln.startswith(f"| {first_cell} | {second_cell_starts}")]
    assert len(rows) == 1, (first_cell, rows)
    return [c.strip() for c in rows[0].strip("|").split("|")]
