"""Planted odd images among real ones: does the ``data_insights`` stage list them first?

Two sets, each with 10 planted images of 10 kinds (:data:`KINDS`) among real ones:

* ``photos``: 400 real-photo crops, 64 x 64 RGB, of 6 colour photographs (scikit-learn's
  ``china`` and ``flower``, scikit-image's ``astronaut``, ``chelsea``, ``coffee``, ``rocket``):
  seeded square windows of 25-80 % of the short side, maybe flipped (:func:`photo_set`);
* ``fmnist``: the 60,000 Fashion-MNIST train images, 28 x 28 grey.

The planted kinds (:func:`junk`) are what a crawl or a camera roll brings in: a blank (black)
image, a solid colour, uniform noise, blurred noise (clouds, no fine grain), a crop of a scanned
text page (scikit-image's ``page``), rendered text, an extreme crop (a few pixels of a real
image blown up), a real image shrunk into blank borders, a truncated image (the rest grey, as a
cut-off JPEG download decodes) and stripes (a synthetic pattern).

Each set is written as shards (``pretrain`` split, labels -1; ``train`` / ``test`` empty as with
``data.source: none``), an encoder is pretrained on it with :func:`pipeline.train.engine.
pretrain` (``--steps``: a short run; 0 = the set's default-length run) or given
(``--encoder``), and the stage's own function (:func:`pipeline.evaluate.run.data_insights.
data_insights`) lists the outliers. Printed, one JSON object: for the stage's ranking and for
each score it is built from, the rank of every planted image and the precision and recall of
the first 12 (``report.insight_images``) and 20 listed.

Usage::

    python benchmarks/planted_outliers.py photos --steps 0 --out /tmp/po-photos  # default length
    python benchmarks/planted_outliers.py fmnist --steps 300 --out /tmp/po-fmnist
    python benchmarks/planted_outliers.py fmnist --encoder models/encoder.pt --out /tmp/po-def
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

FMNIST = Path("/usr/share/datasets/fashion-mnist")
KINDS = ("blank", "solid", "noise", "blurred_noise", "text_scan", "text_rendered",
         "extreme_crop", "blank_borders", "truncated", "stripes")
SHOWN = (12, 20)  # report.insight_images (default), the bar
PHOTO_SOURCES = ("china", "flower", "astronaut", "chelsea", "coffee", "rocket")
WORDS = ("invoice", "total", "page", "scan", "lorem", "ipsum", "dolor", "2026", "ref", "item",
         "qty", "price", "dear", "sir", "note", "the", "and", "of", "to", "in")


def source_photos() -> dict[str, Image.Image]:
    """The 6 colour photographs of :data:`PHOTO_SOURCES`, RGB (427-640 px sides)."""
    import skimage.data
    from sklearn.datasets import load_sample_images

    out = dict(zip(("china", "flower"), (Image.fromarray(a) for a in
                                         load_sample_images().images)))
    for name in PHOTO_SOURCES[2:]:
        out[name] = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
    return out


def photo_set(count: int, *, size: int = 64, seed: int = 0) -> list[Image.Image]:
    """``count`` seeded crops of the source photos, ``size`` px square, RGB.

    Crop ``i`` comes from photo ``i % 6``: a square window of 25-80 % of its short side at a
    seeded place, flipped left-right half the time, resized (bicubic).
    """
    photos = list(source_photos().values())
    out = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        photo = photos[i % len(photos)]
        side = int(min(photo.size) * rng.uniform(0.25, 0.8))
        left = int(rng.integers(0, photo.width - side + 1))
        top = int(rng.integers(0, photo.height - side + 1))
        im = photo.crop((left, top, left + side, top + side)).resize((size, size),
                                                                     Image.BICUBIC)
        out.append(im.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else im)
    return out


def _text(size: int, mode: str, rng: np.random.Generator) -> Image.Image:
    """Lines of random words, dark on light (RGB) or light on dark (L), PIL's default font."""
    bg, fg = ((240, 240, 235), (20, 20, 30)) if mode == "RGB" else (0, 255)
    im = Image.new(mode, (size, size), bg)
    draw = ImageDraw.Draw(im)
    font = ImageFont.load_default(size=max(6, size // 6))
    step = max(7, size // 5)
    for y in range(1, size, step):
        draw.text((1, y), " ".join(rng.choice(WORDS, 4)), fill=fg, font=font)
    return im


def _text_scan(size: int, mode: str, rng: np.random.Generator) -> Image.Image:
    """A seeded square crop of scikit-image's scanned text page, ``size`` px."""
    import skimage.data

    page = Image.fromarray(skimage.data.page())  # (191, 384) grey scan
    side = int(rng.integers(80, 150))
    left, top = int(rng.integers(0, page.width - side)), int(rng.integers(0, page.height - side))
    return page.crop((left, top, left + side, top + side)).resize(
        (size, size), Image.BILINEAR).convert(mode)


def junk(kind: str, real: list[Image.Image], *, size: int, mode: str,
         rng: np.random.Generator) -> Image.Image:
    """One planted image of ``kind`` (:data:`KINDS`), ``size`` px square, in ``mode``.

    ``real`` gives the real images that ``extreme_crop``, ``blank_borders`` and ``truncated``
    start from (one drawn with ``rng``).
    """
    channels = 3 if mode == "RGB" else 1
    shape = (size, size, channels) if channels == 3 else (size, size)
    source = real[int(rng.integers(len(real)))]
    if kind == "blank":
        return Image.new(mode, (size, size), 0)
    if kind == "solid":
        colour = tuple(int(c) for c in rng.integers(40, 216, channels))
        return Image.new(mode, (size, size), colour if channels == 3 else colour[0])
    if kind == "noise":
        return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)
    if kind == "blurred_noise":
        small = rng.integers(0, 256, (size // 4, size // 4) + shape[2:], dtype=np.uint8)
        return Image.fromarray(small, mode).resize((size, size), Image.BICUBIC).filter(
            ImageFilter.GaussianBlur(size / 32))
    if kind == "text_scan":
        return _text_scan(size, mode, rng)
    if kind == "text_rendered":
        return _text(size, mode, rng)
    if kind == "extreme_crop":
        side = max(3, size // 10)
        left, top = (int(v) for v in rng.integers(size // 4, size - size // 4 - side, 2))
        return source.crop((left, top, left + side, top + side)).resize((size, size),
                                                                       Image.BICUBIC)
    if kind == "blank_borders":
        canvas = Image.new(mode, (size, size), (255,) * channels if channels == 3 else 255)
        inner = max(4, size * 3 // 10)
        canvas.paste(source.resize((inner, inner), Image.BILINEAR), ((size - inner) // 2,) * 2)
        return canvas
    if kind == "truncated":
        a = np.asarray(source).copy()
        a[int(size * rng.uniform(0.25, 0.45)):] = 128  # a cut-off JPEG decodes grey below
        return Image.fromarray(a, mode)
    if kind == "stripes":
        period = int(rng.integers(3, 7))
        row = ((np.arange(size) // period) % 2 * 255).astype(np.uint8)
        a = np.broadcast_to(row[None, :] if rng.random() < 0.5 else row[:, None], (size, size))
        return Image.fromarray(np.ascontiguousarray(a), "L").convert(mode)
    raise ValueError(f"unknown junk kind {kind!r}; known: {', '.join(KINDS)}")


def plant_outliers(real: list[Image.Image], *, kinds: tuple[str, ...] = KINDS, seed: int = 0
                   ) -> tuple[list[Image.Image], list[str], dict[str, str]]:
    """Real images with one planted image of each kind inserted at seeded places.

    Args:
        real: the real images, all the same square size and mode (keys ``img00000``...).
        kinds: one planted image per entry (:data:`KINDS`).
        seed: where they go and how they are drawn.

    Returns:
        ``(images, keys, planted)``: every image, its key, and ``{key: kind}`` of the planted
        ones (keys ``odd_<kind>_<n>``).
    """
    rng = np.random.default_rng(seed)
    size, mode = real[0].width, real[0].mode
    images = list(real)
    keys = [f"img{i:05d}" for i in range(len(real))]
    planted: dict[str, str] = {}
    for n, kind in enumerate(kinds):
        at = int(rng.integers(0, len(images) + 1))
        key = f"odd_{kind}_{n}"
        images.insert(at, junk(kind, real, size=size, mode=mode, rng=rng))
        keys.insert(at, key)
        planted[key] = kind
    return images, keys, planted


def precision_recall(ranked: list[str], planted: dict[str, str],
                     shown: tuple[int, ...] = SHOWN) -> dict[str, float]:
    """Precision and recall of the planted keys among the first ``n`` of ``ranked``, each n."""
    out: dict[str, float] = {}
    for n in shown:
        hit = sum(k in planted for k in ranked[:n])
        out[f"found_top{n}"] = hit
        out[f"precision_top{n}"] = round(hit / n, 4)
        out[f"recall_top{n}"] = round(hit / len(planted), 4)
    return out


def write_set(shards_dir: Path, images: list[Image.Image], keys: list[str]) -> None:
    """``shards_dir/pretrain`` (every image, label -1) and empty ``train`` / ``test`` splits,
    as ``data.source: none`` builds them."""
    from pipeline.data.build import empty_split, write_shards
    from pipeline.data.sources import Sample

    mode = images[0].mode
    write_shards([Sample(k, im, -1) for k, im in zip(keys, images)], shards_dir / "pretrain",
                 split="pretrain", source="none", class_names=(), mode=mode,
                 samples_per_shard=10_000, progress=False)
    for split in ("train", "test"):
        empty_split(shards_dir / split, split=split, source="none", class_names=(), mode=mode,
                    build={})


def recipe(which: str, steps: int, images: int, threads: int | str = "auto") -> dict:
    """Param overrides of the pretraining run: ``params.yaml``'s recipe, the set's augmentation,
    ``steps`` optimizer steps (0 = the default 7 epochs), the monitor off (no labels)."""
    batch = 64  # pretrain.batch_size
    per_epoch = images // batch
    opt: dict = {"knn_every_epochs": 0, "labelfree_images": 0, "batch_size": batch,
                 "num_threads": threads}
    if steps:
        opt.update(epochs=max(1, -(-steps // per_epoch)), steps_per_epoch=min(steps, per_epoch))
    if which == "photos":  # a tree of colour photos without labels (the shards are built here)
        return {"data": {"source": "none", "unlabelled_root": "photos"},
                "augment": {"preset": "v2"}, "pretrain": opt,
                "moco": {"K": 256}}  # K < the 410 images (moco#146)
    return {"pretrain": opt}


def pretrain_encoder(shards_dir: Path, out: Path, overrides: dict, seed: int = 0) -> Path:
    """Pretrain on ``shards_dir/pretrain`` with ``params.yaml`` + ``overrides``; the encoder path.
    """
    from pipeline.config import from_dict, read_yaml
    from pipeline.train.engine import pretrain

    tree = read_yaml(Path(__file__).resolve().parents[1] / "params.yaml")
    for sec, vals in overrides.items():
        tree.setdefault(sec, {}).update(vals)
    tree["seed"] = seed
    p = from_dict(tree)
    pretrain(model=p.model, moco=p.moco, opt=p.pretrain, augment=p.augment, seed=p.seed,
             shards_dir=shards_dir, encoder_path=out / "encoder.pt",
             checkpoint_dir=out / "ckpt", metrics_path=out / "pretrain.json",
             plots_path=out / "pretrain.tsv", knn_plots_path=out / "knn.tsv")
    return out / "encoder.pt"


def rank_by(details: dict, keys: list[str]) -> dict[str, list[str]]:
    """Every image's key in the order of the stage's outlier score and of each view alone.

    ``outlier_score``: the stage's list; each view of ``details["views"]``: its z-score, highest
    first; ``mean_cosine``: the stage's score before this change (lowest mean cosine to the
    neighbours first). Ties keep the stage's order. ``details`` must list every image.
    """
    rows = details["outliers"]
    if len(rows) != len(keys):
        raise ValueError(f"{len(rows)} outliers listed for {len(keys)} images: set "
                         "insights.listed to the set's size")
    out = {"outlier_score": [o["key"] for o in rows],
           "mean_cosine": [o["key"] for o in sorted(rows, key=lambda o: o["mean_cosine"])]}
    for view in details["views"]:
        out[view] = [o["key"] for o in sorted(rows, key=lambda o: -o["views"][view])]
    return out


def measure(details: dict, keys: list[str], planted: dict[str, str]) -> dict:
    """Precision / recall in the first :data:`SHOWN` and each planted image's rank, per ranking.
    """
    out = {}
    for name, ranked in rank_by(details, keys).items():
        place = {k: n + 1 for n, k in enumerate(ranked)}
        out[name] = {**precision_recall(ranked, planted),
                     "rank": {kind: place[k] for k, kind in planted.items()}}
    top = details["outliers"][: max(SHOWN)]
    out["outlier_score"]["top20"] = [{"key": o["key"], "reason": o["reason"],
                                      "score": o["score"]} for o in top]
    return out


def contact_sheet(images: dict[str, Image.Image], ranked: list[str], planted: dict[str, str],
                  path: Path, count: int = 20, side: int = 64) -> None:
    """The first ``count`` of ``ranked`` in rows of 10, planted ones framed red, as a PNG."""
    sheet = Image.new("RGB", (10 * (side + 4), -(-count // 10) * (side + 4)), "white")
    draw = ImageDraw.Draw(sheet)
    for n, key in enumerate(ranked[:count]):
        x, y = (n % 10) * (side + 4), (n // 10) * (side + 4)
        if key in planted:
            draw.rectangle((x, y, x + side + 3, y + side + 3), fill=(220, 30, 30))
        sheet.paste(images[key].convert("RGB").resize((side, side), Image.NEAREST),
                    (x + 2, y + 2))
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)


def run_stage(shards_dir: Path, encoder: Path, out: Path, images: int) -> dict:
    """The stage's own function with ``params.yaml``'s params, every image listed."""
    from pipeline.config import from_dict, read_yaml
    from pipeline.evaluate.run.data_insights import data_insights

    tree = read_yaml(Path(__file__).resolve().parents[1] / "params.yaml")
    tree["insights"]["listed"] = images
    p = from_dict(tree)
    metrics = data_insights(encoder_path=encoder, head_path=None, shards_dir=shards_dir,
                            index_dir=None, image_size=0, embed=p.embed, insights=p.insights,
                            features_dir=out / "features", details_path=out / "details.json")
    return {"metrics": metrics, "details": json.loads((out / "details.json").read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("set", choices=("photos", "fmnist"))
    ap.add_argument("--out", type=Path, required=True, help="shards, encoder and outputs go here")
    ap.add_argument("--steps", type=int, default=300,
                    help="pretraining steps (0 = the default 7 epochs); ignored with --encoder")
    ap.add_argument("--encoder", type=Path, help="an encoder.pt to use instead of pretraining")
    ap.add_argument("--images", type=int, default=0, help="real images (0: 400 / 60,000)")
    ap.add_argument("--plant-seed", type=int, default=0, help="which planted images, and where")
    ap.add_argument("--sheet", type=Path, help="write the first 20 listed here (PNG)")
    ap.add_argument("--threads", default="1", help="pretrain.num_threads and torch's threads "
                    "(1: the 2-core machine is shared)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # to stderr
    import torch

    from pipeline.data.sources.idx import read_idx

    if a.threads != "auto":
        torch.set_num_threads(int(a.threads))
    if a.set == "photos":
        real = photo_set(a.images or 400)
    else:
        pixels = read_idx(FMNIST / "train-images-idx3-ubyte.gz", 3)[: a.images or None]
        real = [Image.fromarray(x, "L") for x in pixels]
    images, keys, planted = plant_outliers(real, seed=a.plant_seed)
    shards = a.out / f"shards-{a.set}-{len(real)}-seed{a.plant_seed}"
    if not (shards / "pretrain/manifest.json").is_file():
        write_set(shards, images, keys)
    t0 = time.time()
    encoder = a.encoder
    if encoder is None:
        run_dir = a.out / f"run-{a.set}-{len(real)}-seed{a.plant_seed}-steps{a.steps}"
        encoder = run_dir / "encoder.pt"
        if not encoder.is_file():
            threads = a.threads if a.threads == "auto" else int(a.threads)
            pretrain_encoder(shards, run_dir, recipe(a.set, a.steps, len(images), threads))
    pretrain_s = time.time() - t0
    stage = run_stage(shards, encoder, a.out / f"stage-{a.set}-seed{a.plant_seed}-"
                                             f"{encoder.parent.name}",
                      len(images))
    if a.sheet:
        contact_sheet(dict(zip(keys, images)), [o["key"] for o in stage["details"]["outliers"]],
                      planted, a.sheet)
    print(json.dumps({"benchmark": "planted_outliers", "set": a.set, "real": len(real),
                      "planted": planted, "plant_seed": a.plant_seed, "encoder": str(encoder),
                      "steps": None if a.encoder else a.steps, "pretrain_s": round(pretrain_s),
                      "stage": {k: stage["metrics"][k] for k in ("embed_s", "search_s",
                                                                  "wall_time_s")},
                      **measure(stage["details"], keys, planted)}))


if __name__ == "__main__":
    main()
