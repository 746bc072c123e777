"""Near-duplicate and outlier search (the ``data_insights`` stage): cost, and recall on real data.

Two measurements, each printed as one JSON object:

``search`` (default): time and peak memory of :func:`pipeline.evaluate.insights.
find_neighbourhoods` on N random D-dim features, each size in a fresh process, first alone
(the search before the outliers' other views), then with them (N x 64 first-stage statistics,
a second search, and N x 3 pixel statistics), and the CPU time of the per-batch statistics the
embedding pass adds, for N = 15,000 / 30,000 / 60,000 at D = 256 (the default encoder's global
feature: ResNet-18 width 32) and N = 60,000 at D = 2048. Peak memory = the process's ``ru_maxrss``
minus its RSS once the features exist, i.e. what the search itself adds; an (N, N) fp32
matrix would be 4 N^2 bytes (14.4 GB at 60,000). Wall and CPU seconds, with the 1-minute load
average at the start (on a shared machine the CPU seconds are the steadier number).

``recall`` (``--encoder models/encoder.pt``): real Fashion-MNIST train images (the first
``--images``) plus ``--planted`` copies of each kind of random other images of the set: exact,
perturbed (resized down by 4-14 % and back up, then JPEG-re-encoded at quality 75-90) and JPEG
only (quality 75-90), embedded like the stage does (eval transform, global pool), then searched
once; for each threshold of ``--thresholds``: the recall of each kind, the pairs above it that
were not planted, and how many real images are in a pair; and the cosine of each real image to
its most similar other (quantiles), beside the planted copies' cosines. ``plant_duplicates``
and ``planted_recall`` are also used by tests/evaluate/test_planted_duplicates.py.

Usage: ``python benchmarks/near_duplicates.py [--sizes 15000x256 60000x2048]``;
``python benchmarks/near_duplicates.py --encoder models/encoder.pt``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

FMNIST = Path("/usr/share/datasets/fashion-mnist")
SIZES = ("15000x256", "30000x256", "60000x256", "60000x2048")
LOW_LEVEL_DIM = 64  # the outliers' second search: 2 x the 32 channels of the default's layer1
THRESHOLDS = (0.98, 0.99, 0.995, 0.997, 0.998, 0.999, 0.9995)


def perturb(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """Resized down by 4-14 % (to 24-27 px of 28) and back up, bilinear, then JPEG at quality
    75-90, decoded: a slightly different copy of the same picture."""
    side = image.width
    small = image.resize((int(round(side * rng.uniform(0.86, 0.96))),) * 2, Image.BILINEAR)
    return jpeg(small.resize((side, side), Image.BILINEAR), int(rng.integers(75, 91)))


def jpeg(image: Image.Image, quality: int) -> Image.Image:
    """``image`` JPEG-encoded at ``quality`` and decoded back (same mode)."""
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return Image.open(io.BytesIO(buf.getvalue())).convert(image.mode)


def plant_duplicates(images: np.ndarray, *, exact: int, perturbed: int, jpeg_only: int = 0,
                     seed: int = 0
                     ) -> tuple[list[Image.Image], list[str], dict[tuple[str, str], str]]:
    """Real images plus planted copies of some of them.

    Args:
        images: (N, H, W) uint8 grey images (keys ``img00000``...).
        exact: copies with the same pixels (keys ``exact000``...).
        perturbed: copies through :func:`perturb` (keys ``perturbed000``...).
        jpeg_only: copies JPEG-re-encoded at quality 75-90 only (keys ``jpeg000``...).
        seed: which images are copied (distinct sources, each copied once) and how.

    Returns:
        ``(images, keys, planted)``: the N originals then the copies, their keys, and
        ``{(source key, copy key): "exact" | "perturbed" | "jpeg"}``.
    """
    rng = np.random.default_rng(seed)
    kinds = ["exact"] * exact + ["perturbed"] * perturbed + ["jpeg"] * jpeg_only
    src = rng.choice(len(images), size=len(kinds), replace=False)
    out = [Image.fromarray(a, "L") for a in images]
    keys = [f"img{i:05d}" for i in range(len(images))]
    planted: dict[tuple[str, str], str] = {}
    for n, (i, kind) in enumerate(zip(src.tolist(), kinds)):
        copy = {"exact": lambda im: im.copy(), "perturbed": lambda im: perturb(im, rng),
                "jpeg": lambda im: jpeg(im, int(rng.integers(75, 91)))}[kind](out[i])
        out.append(copy)
        keys.append(f"{kind}{n:03d}")
        planted[(keys[i], keys[-1])] = kind
    return out, keys, planted


def planted_recall(pairs: list[tuple[str, str]], planted: dict[tuple[str, str], str]
                   ) -> dict[str, float]:
    """Recall of each kind of planted pair among ``pairs`` (either order), and the rest.

    Returns:
        per planted kind: ``found_<kind>`` (count) and ``recall_<kind>`` (fraction), and
        ``not_planted``: the pairs found that were not planted.
    """
    found = {tuple(sorted(p)) for p in pairs}
    out: dict[str, float] = {}
    for kind in sorted(set(planted.values())):
        want = [tuple(sorted(p)) for p, k in planted.items() if k == kind]
        hit = sum(p in found for p in want)
        out[f"found_{kind}"] = hit
        out[f"recall_{kind}"] = round(hit / len(want), 4)
    planted_set = {tuple(sorted(p)) for p in planted}
    out["not_planted"] = sum(p not in planted_set for p in found)
    return out


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def _statistics_seconds(n: int, g: torch.Generator) -> dict[str, float]:
    """CPU seconds of the outliers' per-batch statistics over n images, batches of 512: the
    pixel statistics of 28 px grey images, the channel statistics of 32 x 14 x 14 maps (the
    default encoder's first stage at 28 px)."""
    from pipeline.evaluate.insights import channel_statistics, pixel_statistics

    images = torch.randn(512, 1, 28, 28, generator=g)
    maps = torch.rand(512, 32, 14, 14, generator=g)
    out = {}
    for name, fn, x in (("pixel_statistics_s", pixel_statistics, images),
                        ("channel_statistics_s", channel_statistics, maps)):
        c0 = time.process_time()
        for _ in range(-(-n // 512)):
            fn(x)
        out[name] = round(time.process_time() - c0, 2)
    return out


def search_one(n: int, d: int) -> dict[str, float]:
    """Time and memory of one search on (n, d) random features (run in a fresh process): the
    embedding's search alone (near-duplicates and the ``embedding`` view), then the stage's
    (with the ``low_level`` search and the pixel views); peak memory is the larger."""
    from pipeline.evaluate.insights import find_neighbourhoods
    from pipeline.evaluate.knn import DEFAULT_SELF_BLOCK_SIZE

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    low = torch.randn(n, LOW_LEVEL_DIM, generator=g)  # the first stage's channel statistics
    pixels = torch.rand(n, 3, generator=g)  # pixel statistics
    base = _rss_bytes()
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    find_neighbourhoods(x, duplicate_cosine=0.98, k=10)
    alone, alone_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    nb = find_neighbourhoods(x, duplicate_cosine=0.98, k=10, low_level=low, pixels=pixels)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"images": n, "dim": d, "low_level_dim": LOW_LEVEL_DIM, "k": 10,
            "block_size": DEFAULT_SELF_BLOCK_SIZE,
            "threads": torch.get_num_threads(), "load_average_1min": round(load, 2),
            "embedding_only_seconds": round(alone, 2),
            "embedding_only_cpu_seconds": round(alone_cpu, 2),
            "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
            **_statistics_seconds(n, g),
            "features_mib": round(4 * n * d / 2**20, 1),
            "search_peak_extra_mib": round((peak - base) / 2**20, 1),
            "n_by_n_fp32_mib": round(4 * n * n / 2**20, 1), "pairs": len(nb.pairs)}


def _embed_images(encoder: Path, images: list[Image.Image], keys: list[str],
                  batch_size: int) -> torch.Tensor:
    """(N, C) global features with the stage's transform (Fashion-MNIST's mean/std)."""
    from pipeline.data.sources.idx import FashionMnistSource
    from pipeline.data.views import build_eval_transform
    from pipeline.evaluate.run.embed import Embedder

    tf = build_eval_transform(28, FashionMnistSource.mean, FashionMnistSource.std)
    batches = ((torch.stack([tf(im) for im in images[i:i + batch_size]]),
                torch.full((len(images[i:i + batch_size]),), -1), keys[i:i + batch_size])
               for i in range(0, len(images), batch_size))
    return Embedder(encoder)(batches, desc="embed")[1].features


def recall(args: argparse.Namespace) -> dict:
    """The ``recall`` measurement (module docstring): one search, every threshold from it."""
    from pipeline.data.sources.idx import read_idx
    from pipeline.evaluate.insights import duplicate_pairs
    from pipeline.evaluate.knn import self_neighbours

    base = read_idx(FMNIST / "train-images-idx3-ubyte.gz", 3)[: args.images]
    images, keys, planted = plant_duplicates(base, exact=args.planted, perturbed=args.planted,
                                             jpeg_only=args.planted)
    t0 = time.perf_counter()
    feats = _embed_images(args.encoder, images, keys, batch_size=512)
    embed_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sim, idx = self_neighbours(feats, k=10)  # (N, 10) each: the stage's search
    search_s = time.perf_counter() - t0
    copied = {keys.index(a) for a, _ in planted}
    real = sim[[i for i in range(len(base)) if i not in copied], 0]  # nearest other, not a copy
    rows = []
    for thr in args.thresholds:
        pairs, _ = duplicate_pairs(sim, idx, thr)
        named = [(keys[i], keys[j]) for i, j in pairs.tolist()]
        in_pairs = torch.unique(pairs)
        rows.append({"threshold": thr, "pairs": len(named), **planted_recall(named, planted),
                     "real_images_in_pairs": int((in_pairs < len(base)).sum())})
    fn = torch.nn.functional.normalize(feats, dim=1)
    cos = {kind: [float(fn[keys.index(a)] @ fn[keys.index(b)]) for (a, b), k in planted.items()
                  if k == kind] for kind in ("perturbed", "jpeg")}
    return {"benchmark": "near_duplicates_recall", "encoder": str(args.encoder),
            "images": len(images), "planted_each": args.planted, "embed_s": round(embed_s, 1),
            "search_s": round(search_s, 1),
            "nearest_other_cosine_quantiles": {str(q): round(float(real.quantile(q)), 5)
                                               for q in (0.5, 0.9, 0.99, 0.999)},
            "planted_cosine_quantiles": {kind: {str(q): round(float(np.quantile(v, q)), 5)
                                                for q in (0.1, 0.5, 0.9)}
                                         for kind, v in cos.items()},
            "thresholds": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), help="NxD, each in a process")
    ap.add_argument("--encoder", type=Path, help="measure recall with this models/encoder.pt")
    ap.add_argument("--images", type=int, default=60_000, help="recall: real images")
    ap.add_argument("--planted", type=int, default=200, help="recall: copies of each kind")
    ap.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one NxD search, this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(search_one(*map(int, args.one.split("x")))))
        return
    if args.encoder:
        print(json.dumps(recall(args)))
        return
    runs = []
    for size in args.sizes:
        out = subprocess.run([sys.executable, __file__, "--one", size], capture_output=True,
                             text=True, check=True).stdout
        runs.append(json.loads(out))
    print(json.dumps({"benchmark": "near_duplicates_search", "torch": torch.__version__,
                      "runs": runs}))


if __name__ == "__main__":
    main()
