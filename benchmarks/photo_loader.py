"""Photos at GPU speed: shard bytes and two-view loader pairs/s per core; prints one JSON object.

The photos: an ImageFolder of real-photo JPEGs, ``--root``, or by default ``--count`` crops of
scikit-learn's two sample photos (``benchmarks/sample_photos.py``: 500 x 375 px, quality 90).
Their shards are built with ``build_shards``' own code (:func:`pipeline.data.build.build_all`,
``data.source: imagefolder``, whole images, ``data.max_side``):

* ``native``: ``max_side`` above every photo: each JPEG keeps its bytes (``shard_format:
  auto``);
* ``side256``: ``max_side`` 256: each photo resized to a 256 px short side, stored as JPEG
  quality 95;
* ``png`` and ``png256``: the same pixels as lossless PNG (``shard_format: png``, the only
  format before), for the bytes only.

``bytes`` prints shard bytes / source bytes (all splits of a build hold every photo once:
``pretrain`` + ``test``).

Loaders, two ``--side`` px views per image (RandomResizedCrop scale 0.2-1, MoCo's), all in
this one process on one thread (``num_workers 0``, ``torch.set_num_threads(1)``), so pairs/s
is pairs/s per loader core:

* ``ours_native`` / ``ours_256``: :func:`pipeline.data.loader.train_loader` over the shards
  with the per-image crop (what ``pretrain`` runs with ``data.max_side``), JPEG draft on;
* ``ours_native_full``: the same with every JPEG decoded in full (draft off);
* ``ours_256_decode_jpeg``: ``decode="device"`` on the CPU: the workers read headers only, the
  batch is decoded with ``torchvision.io.decode_jpeg`` and cut with tensor ops (the GPU path's
  code, here on libjpeg-turbo);
* ``torchvision``: the plain baseline, ``torchvision.datasets.ImageFolder`` over the source
  folder with ``RandomResizedCrop`` x 2 + ``PILToTensor`` and a ``DataLoader``.

The machine is shared and noisy (+-30 %): the variants run interleaved, ``--rounds`` times, one
pass over the split each, and the medians are printed. ``decode`` gives decode-only images/s
per thread on the source JPEGs: PIL full, PIL draft 1/2, 1/4, 1/8, ``torchvision.io.
decode_jpeg``; ``draft_small`` the loader at ``--small-side`` px (where draft applies to these
photos) with draft on and off. ``cores_for`` is the loader cores that 1,800 pairs/s (a
ResNet-50 MoCo v2 step on one A100/H100, docs/performance.md) needs at each variant's rate.

Usage: ``python benchmarks/photo_loader.py [--root DIR] [--count 200] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sample_photos import write_photos  # noqa: E402

from pipeline.config import DataParams  # noqa: E402
from pipeline.data.build import build_all  # noqa: E402
from pipeline.data.loader import read_manifest, train_loader  # noqa: E402
from pipeline.data.views import SeededRandomResizedCrop  # noqa: E402

GPU_PAIRS_PER_S = 1800  # ResNet-50 MoCo v2 step, one A100/H100 (FACTS.md, docs/performance.md)
SCALE = (0.2, 1.0)  # MoCo v2's RandomResizedCrop area range


def build(root: Path, out: Path, *, max_side: int, shard_format: str, side: int) -> dict:
    """Shards of ``root`` under ``out`` (build_all, run from ``out``: its own index dir)."""
    params = DataParams(source="imagefolder", root=str(root), image_size=side,
                        max_side=max_side, shard_format=shard_format, test_fraction=0.05,
                        shards_dir=str(out / "shards"), samples_per_shard=1000)
    cwd = os.getcwd()
    os.chdir(out)
    try:
        manifests = build_all(params, seed=0, progress=False)
    finally:
        os.chdir(cwd)
    return {"dir": out / "shards", "bytes": sum(s.bytes for split in ("pretrain", "test")
                                               for s in manifests[split].shards),
            "build": manifests["pretrain"].settings}


def our_rate(shards: Path, *, side: int, batch: int, draft: bool = True,
             decode: str = "workers") -> float:
    """Pairs/s of one pass of train_loader over ``shards/pretrain``, one thread."""
    manifest = read_manifest(shards / "pretrain")
    steps = manifest.num_samples // batch
    loader = train_loader(shards / "pretrain", batch_size=batch, steps=steps, epoch=0, seed=0,
                          crop=SeededRandomResizedCrop(side, scale=SCALE), draft=draft,
                          decode=decode)
    t0 = time.perf_counter()
    n = 0
    for images, _ in loader:
        if decode == "device":
            images = images.to(torch.device("cpu"))
        n += images.shape[0]
    return n / (time.perf_counter() - t0)


def torchvision_rate(root: Path, *, side: int, batch: int) -> float:
    """Pairs/s of the plain ImageFolder + RandomResizedCrop x 2 DataLoader, one pass."""
    from torch.utils.data import DataLoader
    from torchvision import datasets
    from torchvision import transforms as T

    crop = T.Compose([T.RandomResizedCrop(side, scale=SCALE), T.PILToTensor()])
    data = datasets.ImageFolder(str(root), transform=lambda im: (crop(im), crop(im)))
    loader = DataLoader(data, batch_size=batch, shuffle=True, num_workers=0, drop_last=True)
    t0 = time.perf_counter()
    n = 0
    for (q, _k), _ in loader:
        n += q.shape[0]
    return n / (time.perf_counter() - t0)


def decode_rates(paths: list[Path], rounds: int) -> dict:
    """Decode-only images/s per thread on the source JPEGs (medians over ``rounds``)."""
    from torchvision.io import decode_jpeg

    from pipeline.data.external import open_image

    blobs = [p.read_bytes() for p in paths]
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    variants = {
        "pil_full": lambda i: open_image(blobs[i]),
        "pil_draft_1_2": lambda i: open_image(blobs[i], reduce=lambda _: 2),
        "pil_draft_1_4": lambda i: open_image(blobs[i], reduce=lambda _: 4),
        "pil_draft_1_8": lambda i: open_image(blobs[i], reduce=lambda _: 8),
        "torchvision_decode_jpeg": lambda i: decode_jpeg(tensors[i]),
    }
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for i in range(len(blobs)):
                fn(i)
            rates[name].append(len(blobs) / (time.perf_counter() - t0))
    return {k: round(statistics.median(v)) for k, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", help="an ImageFolder of JPEG photos (default: sample crops)")
    ap.add_argument("--count", type=int, default=200, help="sample crops to write")
    ap.add_argument("--side", type=int, default=224, help="view side in px")
    ap.add_argument("--small-side", type=int, default=112, help="view side for draft_small")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root = Path(a.root) if a.root else tmp / "photos"
        if not a.root:
            write_photos(root, count=a.count)
        paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
        source_bytes = sum(p.stat().st_size for p in paths)
        builds = {}
        for name, max_side, fmt in (("native", 1 << 16, "auto"), ("side256", 256, "auto"),
                                    ("png", 1 << 16, "png"), ("png256", 256, "png")):
            (tmp / name).mkdir()
            builds[name] = build(root, tmp / name, max_side=max_side, shard_format=fmt,
                                 side=min(a.side, 256))
        variants = {
            "ours_native": lambda: our_rate(builds["native"]["dir"], side=a.side,
                                            batch=a.batch_size),
            "ours_native_full": lambda: our_rate(builds["native"]["dir"], side=a.side,
                                                 batch=a.batch_size, draft=False),
            "ours_256": lambda: our_rate(builds["side256"]["dir"], side=a.side,
                                         batch=a.batch_size),
            "ours_256_decode_jpeg": lambda: our_rate(builds["side256"]["dir"], side=a.side,
                                                     batch=a.batch_size, decode="device"),
            "torchvision": lambda: torchvision_rate(root, side=a.side, batch=a.batch_size),
            "small_draft": lambda: our_rate(builds["native"]["dir"], side=a.small_side,
                                            batch=a.batch_size),
            "small_full": lambda: our_rate(builds["native"]["dir"], side=a.small_side,
                                           batch=a.batch_size, draft=False),
        }
        for fn in variants.values():  # warm-up: imports, page cache, sha256 of the shards
            fn()
        rates: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.rounds):
            for name, fn in variants.items():
                rates[name].append(fn())
        med = {k: round(statistics.median(v)) for k, v in rates.items()}
        base = med["torchvision"]
        out = {
            "photos": {"count": len(paths), "source_bytes": source_bytes,
                       "mean_kib": round(source_bytes / len(paths) / 1024, 1),
                       "root": a.root or f"{a.count} sample crops"},
            "bytes": {k: round(b["bytes"] / source_bytes, 3) for k, b in builds.items()},
            "members": {k: b["build"].get("members") for k, b in builds.items()},
            "side": a.side, "batch_size": a.batch_size, "rounds": a.rounds,
            "pairs_per_s_per_core": med,
            "runs": {k: [round(x) for x in v] for k, v in rates.items()},
            "vs_torchvision": {k: round(v / base, 2) for k, v in med.items()
                               if k.startswith("ours")},
            "draft_small": {"side": a.small_side,
                            "speedup": round(med["small_draft"] / med["small_full"], 2)},
            "decode_img_per_s": decode_rates(paths, a.rounds),
            "cores_for": {k: math.ceil(GPU_PAIRS_PER_S / v) for k, v in med.items()
                          if not k.startswith("small")},
            "cpu": os.cpu_count(),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
