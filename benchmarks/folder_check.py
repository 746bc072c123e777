"""Time what ``index_shards`` spends on a changed image folder: the walk, headers, decoding.

What it is for: the cost of :func:`pipeline.data.folder_index.index_folders`' decode check (every
image's pixels, a JPEG at 1/8 scale) against the header-only scan it replaced, on one tree in
the same run. Rounds are interleaved (walk, headers, decode; repeated), so the page cache and
the machine's drift hit each alike; the first round warms the cache and is not counted.

A plain full decode of every file is timed too, for the gain of the 1/8 JPEG scale.

Usage: ``python benchmarks/folder_check.py --root data/raw/fmnist-unlabelled`` (the tree of
``benchmarks/fmnist_unlabelled_tree.py``); ``--photos N`` instead writes N synthetic
1600 x 1200 JPEG photos (smooth gradients and noise, quality 90) into a temporary folder and
times those. Prints one JSON object: the medians in seconds and the ratio decode / headers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.data.sources.files import scan_headers
from pipeline.data.sources.unlabelled import walk_images


def write_photos(out: Path, n: int) -> None:
    """``n`` seeded 1600 x 1200 RGB JPEGs: a gradient plus noise, so they compress like photos."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:1200, 0:1600]
    for i in range(n):
        base = (xx * (i + 1) / 1600 + yy / 1200) * 100 % 256
        arr = np.clip(base[..., None] + rng.normal(0, 12, (1200, 1600, 3)), 0, 255)
        Image.fromarray(arr.astype(np.uint8)).save(out / f"{i:04d}.jpg", quality=90)


def time_tree(root: Path, repeats: int) -> dict[str, float | int]:
    """Medians (s) over ``repeats`` rounds: the walk, the header scan, the decode scan, and a
    plain full decode of every file (``Image.open(path).load()``, no 1/8 JPEG scale)."""
    times: dict[str, list[float]] = {"walk": [], "headers": [], "decode": [], "full_decode": []}
    paths: list[str] = []
    for r in range(repeats + 1):
        t = time.perf_counter()
        paths, _ = walk_images(root)
        walk = time.perf_counter() - t
        t = time.perf_counter()
        scan_headers(paths)
        headers = time.perf_counter() - t
        t = time.perf_counter()
        scan_headers(paths, decode=True)
        decode = time.perf_counter() - t
        t = time.perf_counter()
        for path in paths:  # what the build's decode costs: every pixel, JPEGs at full scale
            with Image.open(path) as im:
                im.load()
        full = time.perf_counter() - t
        if r:  # round 0 fills the page cache
            for k, v in (("walk", walk), ("headers", headers), ("decode", decode),
                         ("full_decode", full)):
                times[k].append(v)
    med = {f"{k}_s": round(statistics.median(v), 3) for k, v in times.items()}
    return {"images": len(paths), **med,
            "decode_over_headers": round(med["decode_s"] / med["headers_s"], 2),
            "decode_over_full_decode": round(med["decode_s"] / med["full_decode_s"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, help="an image tree (any nesting)")
    ap.add_argument("--photos", type=int, default=0, help="time N synthetic JPEG photos instead")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.photos:
        with tempfile.TemporaryDirectory() as tmp:
            write_photos(Path(tmp), args.photos)
            out = {"tree": f"{args.photos} synthetic 1600x1200 JPEGs",
                   **time_tree(Path(tmp), args.repeats)}
    elif args.root:
        out = {"tree": str(args.root), **time_tree(args.root, args.repeats)}
    else:
        ap.error("give --root or --photos")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
