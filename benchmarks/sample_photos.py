"""Real-photo JPEGs for benchmarks and tests: crops of scikit-learn's two sample photos.

``sklearn.datasets.load_sample_images()`` ships two real photographs (``china.jpg``,
``flower.jpg``, 640 x 427 px, inside the scikit-learn wheel): the only real photos this project
can reach offline. Each crop here is a seeded window of one of them, optionally flipped, saved
as a baseline JPEG (quality 90 by default, 4:2:0, as cameras and most photo collections
store them), so a folder of them decodes, compresses and crops like a folder of photos.

Layouts (:func:`write_photos`):

* ``labelled``: ``root/<class>/<name>.jpg``, an ImageFolder; the class is the source photo and
  the half of it the window starts in (``china_left``, ``china_right``, ``flower_left``,
  ``flower_right``).
* ``unlabelled``: ``root/<a>/<b>/<name>.jpg``, a tree without class folders.

Run as a script to write a folder::

    python benchmarks/sample_photos.py OUT --count 200 [--width 500 --height 375] [--unlabelled]
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
from PIL import Image

SOURCES = ("china", "flower")  # load_sample_images() order


def sample_photos() -> list[Image.Image]:
    """The two scikit-learn sample photos as RGB PIL images (640 x 427 px)."""
    from sklearn.datasets import load_sample_images

    return [Image.fromarray(a) for a in load_sample_images().images]


def photo_crop(photos: list[Image.Image], i: int, *, width: int, height: int, seed: int
               ) -> tuple[str, Image.Image]:
    """Crop ``i``: ``(class name, image)``, a seeded ``width x height`` window, maybe flipped.

    Raises:
        ValueError: the window does not fit the photos.
    """
    rng = np.random.default_rng([seed, i])
    src = i % len(photos)
    photo = photos[src]
    if width > photo.width or height > photo.height:
        raise ValueError(f"a {width}x{height} crop does not fit the {photo.width}x"
                         f"{photo.height} sample photos")
    left = int(rng.integers(0, photo.width - width + 1))
    top = int(rng.integers(0, photo.height - height + 1))
    image = photo.crop((left, top, left + width, top + height))
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    half = "left" if left + width / 2 < photo.width / 2 else "right"
    return f"{SOURCES[src]}_{half}", image


def jpeg_bytes(image: Image.Image, quality: int = 90) -> bytes:
    """Baseline JPEG, 4:2:0, no metadata."""
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality, subsampling=2)
    return buf.getvalue()


def write_photos(root: str | Path, *, count: int, width: int = 500, height: int = 375,
                 quality: int = 90, seed: int = 0, labelled: bool = True) -> list[Path]:
    """Write ``count`` photo crops as JPEG files under ``root``.

    Args:
        root: output directory (created).
        count: number of files.
        width: crop width in px (at most 640).
        height: crop height in px (at most 427).
        quality: JPEG quality of the files.
        seed: seeds the windows and flips.
        labelled: class folders (ImageFolder) when True, else a two-level tree without classes.

    Returns:
        The written paths, in order.
    """
    root = Path(root)
    photos = sample_photos()
    paths = []
    for i in range(count):
        cls, image = photo_crop(photos, i, width=width, height=height, seed=seed)
        sub = Path(cls) if labelled else Path(f"d{i % 3}") / f"e{i % 2}"
        path = root / sub / f"photo_{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg_bytes(image, quality))
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--width", type=int, default=500)
    ap.add_argument("--height", type=int, default=375)
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--unlabelled", action="store_true")
    a = ap.parse_args()
    paths = write_photos(a.out, count=a.count, width=a.width, height=a.height,
                         quality=a.quality, seed=a.seed, labelled=not a.unlabelled)
    print(f"{len(paths)} JPEGs, {sum(p.stat().st_size for p in paths)} bytes under {a.out}")


if __name__ == "__main__":
    main()
