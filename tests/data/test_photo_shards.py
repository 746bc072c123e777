"""Shards keep compressed bytes (``data.shard_format``), on real photos.

The photos are crops of scikit-learn's two sample photographs saved as JPEG quality 90
(``benchmarks/sample_photos.py``). Expected values come from the files themselves (their bytes,
their pixels decoded by PIL, turned by hand with numpy), never from the build's own code.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_samples, tag_photos, upright_reference, write_photos
from PIL import Image

from pipeline.config import DataParams
from pipeline.data.build import build_all, write_shards
from pipeline.data.shards import verify_shards


def members(split_dir: Path) -> dict[str, bytes]:
    """``{member name: bytes}`` of every image member of a split's shards."""
    out = {}
    for tar in sorted(split_dir.glob("*.tar")):
        with tarfile.open(tar) as t:
            for m in t.getmembers():
                if not m.name.endswith(".cls"):
                    out[m.name] = t.extractfile(m).read()
    return out


def build(root: Path, out: Path, *, max_side: int = 1024, image_size: int = 64,
          shard_format: str = "auto", unlabelled: Path | None = None,
          monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.chdir(out.parent)  # the folder index is read from the working directory
    params = DataParams(source="imagefolder", root=str(root), image_size=image_size,
                        max_side=max_side, shard_format=shard_format, test_fraction=0.25,
                        shards_dir=str(out), samples_per_shard=10,
                        unlabelled_root=str(unlabelled or ""))
    return build_all(params, seed=0, progress=False)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / max(mse, 1e-12)))


def decode(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos") / "folder"
    write_photos(root, count=24, width=320, height=240)
    return root


def test_build__unchanged_jpegs_keep_their_bytes(photos, tmp_path, monkeypatch):
    manifests = build(photos, tmp_path / "shards", monkeypatch=monkeypatch)
    files = {p.read_bytes() for p in photos.rglob("*.jpg")}
    stored = {**members(tmp_path / "shards" / "pretrain"), **members(tmp_path / "shards/test")}
    assert len(stored) == 24 and all(name.endswith(".jpg") for name in stored)
    assert set(stored.values()) == files  # byte for byte: every file once, nothing else
    m = manifests["pretrain"]
    assert m.build["shard_format"] == "auto" and m.build["jpeg_quality"] == 95
    assert m.num_samples + manifests["test"].num_samples == 24
    assert m.build["members"] == {"jpg_copied": m.num_samples, "jpg_encoded": 0, "png": 0}
    for split in ("pretrain", "train", "test"):
        verify_shards(tmp_path / "shards" / split)  # every member decodes, sizes and hashes


def test_build__resized_jpegs_are_jpeg_q95_of_the_resized_pixels(photos, tmp_path,
                                                                   monkeypatch):
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    build(photos, tmp_path / "shards", max_side=128, monkeypatch=monkeypatch)
    stored = members(tmp_path / "shards" / "test")
    by_name = {p.stem: p for p in photos.rglob("*.jpg")}
    for name, data in stored.items():
        assert name.endswith(".jpg") and data[:3] == b"\xff\xd8\xff"
        src = next(p for stem, p in by_name.items() if name.split(".")[0].endswith(stem))
        with Image.open(src) as im:  # 320 x 240 -> 170 x 128 (torchvision truncates)
            ref = F.resize(im.convert("RGB"), 128, interpolation=InterpolationMode.BICUBIC,
                           antialias=True)
        got = decode(data)
        assert got.shape == (128, 170, 3) == np.asarray(ref).shape
        assert psnr(got, np.asarray(ref)) > 35  # q95 of the resized pixels, not of the source


@pytest.mark.parametrize("side", [64, 128, 239, 240, 500])
def test_resize_short_side_and_center_square__torchvision_bit_for_bit(photos, side):
    # the build resizes with PIL directly (no torch import); torchvision's Resize and
    # CenterCrop on the same PIL images are the reference: landscape, portrait, odd sizes,
    # grey, shrinking, the identity (240) and enlarging (500)
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    from pipeline.data.encode import center_square, resize_short_side

    paths = sorted(photos.rglob("*.jpg"))[:3]
    for path in paths:
        with Image.open(path) as im:
            photo = im.convert("RGB")
        for image in (photo, photo.rotate(90, expand=True), photo.crop((3, 5, 300, 202)),
                      photo.convert("L")):
            ref = F.resize(image, side, interpolation=InterpolationMode.BICUBIC, antialias=True)
            got = resize_short_side(image, side)
            assert got.size == ref.size and got.mode == ref.mode
            assert got.tobytes() == ref.tobytes()
            if min(image.size) == side:
                assert got is image  # torchvision gives the image itself back too
            crop = center_square(got, side)
            assert crop.tobytes() == F.center_crop(ref, [side, side]).tobytes()


def test_build__exif_tagged_jpegs_keep_their_bytes_and_decode_upright(tmp_path, monkeypatch):
    # Orientations 2..8 (flips, 180, the four that swap W and H). Every JPEG's bytes are kept,
    # tag included, and each reader turns it when decoding. PIL's readers decode with the
    # same libjpeg as the reference (exif_transpose of PIL's decode): equal, bit for bit.
    from pipeline.data.eval_loader import eval_loader
    from pipeline.data.external import open_image
    from pipeline.data.shards import decode_record, iter_shard
    from pipeline.report.inputs import load_shard_images

    root = tmp_path / "folder"
    write_photos(root, count=16, width=160, height=120)
    tagged = tag_photos(root)
    assert {Image.open(p).size for p in tagged} == {(160, 120), (120, 160)}  # as stored
    manifests = build(root, tmp_path / "shards", monkeypatch=monkeypatch)
    files = {p.read_bytes(): tagged.get(p, 1) for p in root.rglob("*.jpg")}
    for split in ("pretrain", "test"):
        m = manifests[split]
        assert m.build["members"] == {"jpg_copied": m.num_samples, "jpg_encoded": 0, "png": 0}
        assert m.image_shape == (3, 120, 160)  # the upright size: tags 5-8 swap W and H
        stored = members(tmp_path / "shards" / split)
        assert set(stored.values()) <= set(files)  # every member is a file, byte for byte
        records = [r for s in m.shards
                   for r in iter_shard(tmp_path / "shards" / split / s.name)]
        loader = eval_loader(tmp_path / "shards" / split, batch_size=4,
                             transform=lambda im: torch.from_numpy(np.array(im)))
        evaluated = {k: x.numpy() for xs, _, ks in loader for x, k in zip(xs, ks, strict=True)}
        thumbs = load_shard_images(tmp_path / "shards" / split, [r["__key__"] for r in records])
        for r in records:
            ref = upright_reference(r["jpg"])
            assert ref.shape == (120, 160, 3)
            assert np.array_equal(np.asarray(decode_record(r, "RGB")[1]), ref)  # verify, eval
            assert np.array_equal(evaluated[r["__key__"]], ref)  # eval_loader, data_insights
            assert np.array_equal(np.asarray(thumbs[r["__key__"]]), ref)  # report thumbnails
            half = open_image(r["jpg"], reduce=lambda _: 2)  # draft: 1/2 DCT scale, then turned
            assert np.array_equal(np.asarray(half), upright_reference(r["jpg"], reduce=2))
    assert sum(m.num_samples for m in (manifests["pretrain"], manifests["test"])) == 16
    # by hand, for tag 6 ("rotate 90 degrees clockwise to display"): the file's pixels turned
    # clockwise with numpy are the upright picture
    six = next(p for p, o in tagged.items() if o == 6)
    with Image.open(six) as im:
        raw = np.asarray(im.convert("RGB"))
    assert np.array_equal(np.asarray(open_image(six.read_bytes())), np.rot90(raw, k=-1))


def test_open_image__exif_orientation_turns_the_pixels(tmp_path):
    # one decode function for every PIL reader: tagged bytes come out upright (old code: as
    # stored), the header's upright size says so before any decode
    from pipeline.data.external import open_image, orientation, upright_size

    root = tmp_path / "folder"
    write_photos(root, count=16, width=160, height=120)
    for path, tag in tag_photos(root).items():
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as header:
            assert orientation(header) == tag
            assert upright_size(header) == (160, 120)
        got = open_image(data)
        assert got.size == (160, 120)
        assert np.array_equal(np.asarray(got.convert("RGB")), upright_reference(data))


def test_build__png_stays_png_and_png_format_is_lossless(photos, tmp_path, monkeypatch):
    pngs = tmp_path / "pngs"
    for p in photos.rglob("*.jpg"):  # the same photos as lossless PNG files
        dst = pngs / p.relative_to(photos).with_suffix(".png")
        dst.parent.mkdir(parents=True, exist_ok=True)
        Image.open(p).save(dst)
    m = build(pngs, tmp_path / "a", monkeypatch=monkeypatch)["pretrain"]
    stored = members(tmp_path / "a" / "pretrain")
    assert all(n.endswith(".png") for n in stored)
    assert "shard_format" not in m.build and "members" not in m.build
    sources = {np.asarray(Image.open(p)).tobytes() for p in pngs.rglob("*.png")}
    assert {decode(d).tobytes() for d in stored.values()} <= sources  # lossless
    # shard_format png: the JPEG photos as PNG of their decoded pixels
    build(photos, tmp_path / "b", shard_format="png", monkeypatch=monkeypatch)
    decoded = {np.asarray(Image.open(p)).tobytes() for p in photos.rglob("*.jpg")}
    stored = members(tmp_path / "b" / "pretrain")
    assert all(n.endswith(".png") for n in stored)
    assert {decode(d).tobytes() for d in stored.values()} <= decoded
    # shard_format jpeg: PNG files become JPEG members
    m = build(pngs, tmp_path / "c", shard_format="jpeg", monkeypatch=monkeypatch)["pretrain"]
    assert all(n.endswith(".jpg") for n in members(tmp_path / "c" / "pretrain"))
    assert m.build["members"] == {"jpg_copied": 0, "jpg_encoded": m.num_samples,
                                     "png": 0}


def test_build__rebuild_is_byte_identical(photos, tmp_path, monkeypatch):
    build(photos, tmp_path / "a", max_side=128, monkeypatch=monkeypatch)
    build(photos, tmp_path / "b", max_side=128, monkeypatch=monkeypatch)
    for split in ("pretrain", "train", "test"):
        a = sorted((tmp_path / "a" / split).iterdir())
        b = sorted((tmp_path / "b" / split).iterdir())
        assert [p.name for p in a] == [p.name for p in b]
        assert all(x.read_bytes() == y.read_bytes() for x, y in zip(a, b))


def test_write_shards__arrays_stay_png_and_manifest_as_before(tmp_path):
    # array samples (Fashion-MNIST, CIFAR) carry no file: PNG members, and no field the
    # manifests had not before JPEG members existed
    m = write_shards(make_samples(12), tmp_path / "s", split="train", source="synthetic",
                     class_names=["a", "b", "c", "d"], mode="L", samples_per_shard=5,
                     progress=False, build={"seed": 0})
    assert m.build == {"seed": 0}
    assert set(json.loads((tmp_path / "s/manifest.json").read_text())["build"]) == {"seed"}
    assert all(n.endswith(".png") for n in members(tmp_path / "s"))


def test_build__grey_jpeg_in_colour_folder_keeps_its_bytes(photos, tmp_path, monkeypatch):
    root = tmp_path / "folder"
    write_photos(root, count=8, width=160, height=120)
    grey = sorted(root.rglob("*.jpg"))[1]
    Image.open(grey).convert("L").save(grey, format="JPEG", quality=90)
    build(root, tmp_path / "shards", monkeypatch=monkeypatch)
    stored = {**members(tmp_path / "shards" / "pretrain"), **members(tmp_path / "shards/test")}
    assert grey.read_bytes() in stored.values()  # L -> RGB copies the value: nothing changes
    verify_shards(tmp_path / "shards" / "pretrain")


@pytest.mark.slow
def test_build__photo_shard_bytes_against_the_source_jpegs(tmp_path, monkeypatch):
    # the bounds, on 200 photos as FACTS.md measured them (500 x 375, quality 90)
    root = tmp_path / "folder"
    paths = write_photos(root, count=200)
    source = sum(p.stat().st_size for p in paths)
    ratios = {}
    for name, max_side in (("native", 4096), ("side256", 256)):
        (tmp_path / name).mkdir()
        ms = build(root, tmp_path / name / "shards", max_side=max_side, image_size=224,
                   monkeypatch=monkeypatch)
        stored = sum(s.bytes for split in ("pretrain", "test") for s in ms[split].shards)
        ratios[name] = stored / source
    assert 1.0 < ratios["native"] <= 1.05  # the files plus tar headers and padding
    assert ratios["side256"] <= 1.0


def _truncate_jpeg_member(shard: Path) -> str:
    """Cut one ``.jpg`` member to half its bytes (tar valid); returns the sample key."""
    with tarfile.open(shard) as t:
        items = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    victim = next(m.name for m, _ in items if m.name.endswith(".jpg"))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for m, data in items:
            if m.name == victim:
                data = data[: len(data) // 2]
                m.size = len(data)
            t.addfile(m, io.BytesIO(data))
    shard.write_bytes(out.getvalue())
    return victim.rsplit(".", 1)[0]


@pytest.mark.parametrize("decode", ["workers", "device"])
def test_hostile__truncated_jpeg_member_named_by_verify_and_loader(photos, tmp_path,
                                                                    monkeypatch, decode):
    from helpers import rewrite_manifest

    from pipeline.data.loader import train_loader
    from pipeline.data.shards import ShardError
    from pipeline.data.views import SeededRandomResizedCrop

    build(photos, tmp_path / "shards", monkeypatch=monkeypatch)
    split = tmp_path / "shards" / "pretrain"
    shard = sorted(split.glob("*.tar"))[0]
    key = _truncate_jpeg_member(shard)
    rewrite_manifest(split)  # sizes and hashes agree: only decoding can tell
    with pytest.raises(ShardError, match=rf"{shard.name}.*{key}.*undecodable"):
        verify_shards(split)
    n = json.loads((split / "manifest.json").read_text())["num_samples"]
    loader = train_loader(split, batch_size=n, steps=1, epoch=0, seed=0, decode=decode,
                          crop=SeededRandomResizedCrop(32))
    with pytest.raises(ShardError, match=rf"{shard.name}: sample '{key}'"):
        for images, _ in loader:
            images.to("cpu")
