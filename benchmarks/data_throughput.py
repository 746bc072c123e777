"""Data-layer throughput on real Fashion-MNIST; prints one JSON object.

* shard build: the first ``--images`` train images (a stratified subset, in source order) ->
  ``write_shards`` into a temp dir (PNG encode + tar + sha256), images/s;
* train loader: true-epoch read + decode to uint8 batches over those shards, images/s for each
  ``--workers`` value, worker start-up included;
* two-crop ``v2_grey`` views on one thread: batched on a whole uint8 batch with kornia
  (pipeline.data.batch_augment, what training uses) vs the per-image PIL/torchvision reference
  (pipeline.data.views), pairs/s.

Each figure is the median of ``--repeats`` runs.

Usage: ``python benchmarks/data_throughput.py [--images 10000] [--steps 20] [--batch-size 256]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeline.data.build import write_shards
from pipeline.data.loader import train_loader
from pipeline.data.sources import open_source


def views_rate(images: torch.Tensor, mean, std, repeats: int) -> dict:
    """Two-crop v2_grey pairs/s on one thread: batched kornia views vs per-image PIL reference."""
    from PIL import Image

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests/data"))
    from reference_views import TwoCropTransform, build_pretrain_transform

    from pipeline.data.views import BatchTwoCrop, build_batch_view

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batched = BatchTwoCrop(build_batch_view("v2_grey", 28, mean, std))
        per_image = TwoCropTransform(build_pretrain_transform("v2_grey", 28, mean, std))
        pil = [Image.fromarray(a[0].numpy(), "L") for a in images]
        out = {"batched_kornia": [], "per_image_pil": []}
        for rep in range(repeats):
            t0 = time.perf_counter()
            batched(images, rep)
            out["batched_kornia"].append(len(images) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for i, img in enumerate(pil):
                per_image(img, rep * 100000 + i)
            out["per_image_pil"].append(len(images) / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(threads)
    return {k: round(statistics.median(v)) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--images", type=int, default=10000)
    ap.add_argument("--samples-per-shard", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    src = open_source("fashion_mnist")
    result: dict = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "pretrain"
        build = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            write_shards(src.iter("train", max_images=args.images), shards, split="pretrain",
                         source=src.name, class_names=src.class_names, mode=src.mode,
                         mean=src.mean, std=src.std, samples_per_shard=args.samples_per_shard,
                         progress=False)
            build.append(args.images / (time.perf_counter() - t0))
        result["shard_build"] = {"images": args.images, "images_per_s": round(
            statistics.median(build)), "runs": [round(x) for x in build]}

        loaders, first = {}, None
        for workers in args.workers:
            runs = []
            for rep in range(args.repeats):
                t0 = time.perf_counter()
                n = 0
                for images, _keys in train_loader(shards, batch_size=args.batch_size,
                                                  steps=args.steps, epoch=rep, seed=0,
                                                  num_workers=workers):
                    n += images.shape[0]
                    first = images if first is None else first
                runs.append(n / (time.perf_counter() - t0))
            loaders[str(workers)] = {"images_per_s": round(statistics.median(runs)),
                                     "runs": [round(x) for x in runs]}
        result["train_loader"] = {"what": "read + decode to uint8 batches (no augmentation)",
                                  "batch_size": args.batch_size, "steps": args.steps,
                                  "by_num_workers": loaders}
        result["two_crop_v2_grey_pairs_per_s_1_thread"] = views_rate(first, src.mean, src.std,
                                                                     args.repeats)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
