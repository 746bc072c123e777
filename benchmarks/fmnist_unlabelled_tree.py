"""Fashion-MNIST's 60,000 train images as an unlabelled PNG tree (no labels, no class folders).

What it is for: the real-data check of ``data.unlabelled_root``
(``configs/fashion-mnist-unlabelled.yaml``): the default recipe pretrained on these images as
unlabelled data, evaluated with 6,000 labelled train images and the 10,000 test images from the
``fashion_mnist`` source. The images are read from the checksum-verified idx files
(:class:`pipeline.data.sources.FashionMnistSource`) and written as 28 x 28 grey PNGs
(byte-reproducible: :func:`pipeline.data.encode.encode_png`) under
``<out>/<index // 1000 as 3 digits>/<index as 5 digits>.png``, so the tree's sorted order is the
source order and nothing in a path says the class. The tree is built beside ``--out`` and
renamed into place; an existing ``--out`` is replaced.

Usage: ``python benchmarks/fmnist_unlabelled_tree.py --out data/raw/fmnist-unlabelled``
(about a minute on 2 CPU cores for the 60,000, ~240 MB on disk as 4 KiB blocks; ``--limit N``
writes the first N only). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from pipeline.data.build import _replace_dir
from pipeline.data.encode import encode_png
from pipeline.data.sources import FashionMnistSource

PER_DIR = 1000


def write_tree(out: Path, *, root: str = "", limit: int = 0) -> dict[str, float]:
    """Write the tree; returns ``{"images", "folders", "seconds"}``."""
    t0 = time.monotonic()
    src = FashionMnistSource(root)
    n = src.count("train") if not limit else min(limit, src.count("train"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        for i in range(n):
            sample = src._load("train", i)
            folder = tmp / f"{i // PER_DIR:03d}"
            folder.mkdir(exist_ok=True)
            (folder / f"{i:05d}.png").write_bytes(encode_png(sample.image))
        tmp.chmod(0o755)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"images": n, "folders": (n + PER_DIR - 1) // PER_DIR,
            "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data/raw/fmnist-unlabelled"))
    ap.add_argument("--root", default="", help="the idx files (default: the source's default)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N images (0 = all)")
    args = ap.parse_args()
    print(json.dumps({"out": str(args.out), **write_tree(args.out, root=args.root,
                                                         limit=args.limit)}))


if __name__ == "__main__":
    main()
