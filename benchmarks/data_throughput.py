"""Data-layer throughput on real Fashion-MNIST; prints one JSON object.

* shard build: the first ``--images`` train images (a stratified subset, in source order) ->
  ``write_shards`` into a temp dir (PNG encode + tar + sha256), images/s;
* train loader: two-crop ``v2_grey`` augmentation (pipeline.data.augment) over those shards,
  images/s for each ``--workers`` value, worker start-up included.

Each figure is the median of ``--repeats`` runs.

Usage: ``python benchmarks/data_throughput.py [--images 10000] [--steps 20] [--batch-size 256]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pipeline.data.loader import train_loader
from pipeline.data.shards import write_shards
from pipeline.data.sources import open_source


def two_crop_transform(mean, std):
    try:
        from pipeline.data.augment import TwoCropTransform, build_pretrain_transform

        return "augment.v2_grey", TwoCropTransform(build_pretrain_transform("v2_grey", 28, mean,
                                                                            std))
    except ImportError:  # augment.py not there yet: the same crops with plain torchvision
        from torchvision import transforms as T

        base = T.Compose([T.RandomResizedCrop(28, scale=(0.2, 1.0)), T.RandomHorizontalFlip(),
                          T.ToTensor()])

        def fallback(img, seed):
            torch.manual_seed(seed)
            return base(img), base(img)

        return "torchvision RRC+flip", fallback


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

        name, transform = two_crop_transform(src.mean, src.std)
        loaders = {}
        for workers in args.workers:
            runs = []
            for rep in range(args.repeats):
                t0 = time.perf_counter()
                n = 0
                for q, _k in train_loader(shards, transform=transform,
                                          batch_size=args.batch_size, steps=args.steps,
                                          epoch=rep, seed=0, num_workers=workers):
                    n += q.shape[0]
                runs.append(n / (time.perf_counter() - t0))
            loaders[str(workers)] = {"images_per_s": round(statistics.median(runs)),
                                     "runs": [round(x) for x in runs]}
        result["train_loader"] = {"transform": name, "batch_size": args.batch_size,
                                  "steps": args.steps, "by_num_workers": loaders}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
