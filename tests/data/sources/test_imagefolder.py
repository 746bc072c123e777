"""ImageFolder reader: layouts, keys, splits and unreadable files."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from srchelpers import KEY_CHARS, save

from pipeline.config import DataParams
from pipeline.data.build import build_all
from pipeline.data.shards import iter_shard
from pipeline.data.sources import SourceError, open_source


def test_imagefolder__modes_nesting_and_case(tmp_path: Path):
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 255))
    rgba.putpixel((0, 0), (10, 20, 30, 0))  # fully transparent -> white
    rgba.putpixel((1, 0), (0, 0, 0, 128))  # half black over white -> 255 * 127 / 255 = 127
    pal = Image.new("P", (4, 4), 1)
    pal.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    save(tmp_path / "cats" / "a.png", Image.new("L", (4, 4), 77))
    save(tmp_path / "cats" / "deep" / "er" / "B.Photo.JPG", Image.new("RGB", (4, 4), (0, 0, 255)),
         "JPEG")
    save(tmp_path / "dogs" / "x.PNG", rgba)
    save(tmp_path / "dogs" / "y.bmp", pal)
    save(tmp_path / "owls" / "z.jpeg", Image.new("CMYK", (4, 4), (0, 255, 0, 0)), "JPEG")
    save(tmp_path / "owls" / "w.webp", Image.new("RGB", (4, 4), (5, 6, 7)), "WEBP")
    (tmp_path / "owls" / "notes.txt").write_text("not an image")

    src = open_source("imagefolder", tmp_path, test_fraction=0.5, seed=0)
    assert src.class_names == ("cats", "dogs", "owls")
    assert src.mode == "RGB" and src.native_shape == (3, 4, 4) and src.mean is None
    assert src.splits() == {"pretrain": 3, "train": 3, "test": 3}
    samples = list(src.iter("train")) + list(src.iter("test"))
    by_name = {s.key.split("_", 1)[1]: s for s in samples}
    assert sorted(by_name) == ["cats_a", "cats_deep_er_B_Photo", "dogs_x", "dogs_y", "owls_w",
                               "owls_z"]
    for s in samples:
        assert s.image.mode == "RGB" and set(s.key) <= KEY_CHARS
    assert by_name["cats_a"].image.getpixel((2, 2)) == (77, 77, 77)
    assert by_name["cats_a"].label == 0 and by_name["owls_z"].label == 2
    x = by_name["dogs_x"].image
    assert x.getpixel((0, 0)) == (255, 255, 255)
    assert x.getpixel((1, 0)) == (127, 127, 127)
    assert x.getpixel((2, 2)) == (10, 20, 30)
    assert by_name["dogs_y"].image.getpixel((3, 3)) == (200, 100, 50)
    r, g, b = by_name["owls_z"].image.getpixel((1, 1))  # magenta ink 255 -> (255, 0, 255), JPEG
    assert r > 240 and g < 15 and b > 240
    # seeded split: same seed same split, one image per class in each split
    again = open_source("imagefolder", tmp_path, test_fraction=0.5, seed=0)
    assert [s.key for s in again.iter("test")] == [s.key for s in src.iter("test")]
    assert sorted(src.labels("test")) == [0, 1, 2]


def test_imagefolder__all_grey_is_L(tmp_path: Path):
    la = Image.new("LA", (3, 3), (40, 255))
    la.putpixel((0, 0), (40, 0))
    save(tmp_path / "train" / "a" / "1.png", Image.new("L", (3, 3), 9))
    save(tmp_path / "train" / "b" / "2.png", la)
    save(tmp_path / "test" / "b" / "3.png", Image.new("L", (5, 2), 200))
    src = open_source("imagefolder", tmp_path)
    assert src.mode == "L" and src.native_shape is None  # sizes differ
    assert src.splits() == {"pretrain": 2, "train": 2, "test": 1}
    train = list(src.iter("train"))
    assert [s.label for s in train] == [0, 1]
    assert train[1].image.getpixel((0, 0)) == 255 and train[1].image.getpixel((1, 1)) == 40
    test = list(src.iter("test"))
    assert test[0].label == 1 and test[0].image.size == (5, 2)


def test_imagefolder__unreadable_files_listed(tmp_path: Path):
    save(tmp_path / "a" / "good.png", Image.new("RGB", (4, 4)))
    (tmp_path / "a" / "bad1.png").write_bytes(b"definitely not a png")
    (tmp_path / "b" / "sub").mkdir(parents=True)
    (tmp_path / "b" / "sub" / "bad2.JPG").write_bytes(b"\x00" * 50)
    with pytest.raises(SourceError, match=r"2 unreadable.*bad1\.png.*bad2\.JPG"):
        open_source("imagefolder", tmp_path, test_fraction=0.25)


def test_imagefolder__fifo_named_instead_of_hanging(tmp_path: Path):
    # a build run by hand (no index_shards first) reads every header: a FIFO named like an
    # image would block the open until a writer comes
    import os

    for c in ("a", "b"):
        for i in range(2):
            save(tmp_path / c / f"{i}.png", Image.new("L", (4, 4), i))
    os.mkfifo(tmp_path / "b" / "pipe.png")
    with pytest.raises(SourceError) as e:
        open_source("imagefolder", tmp_path, test_fraction=0.25)
    pipe = tmp_path / "b" / "pipe.png"
    assert str(e.value) == f"1 unreadable image(s): {pipe} (not a regular file)"


def test_imagefolder__truncated_image_named_during_iteration(tmp_path: Path):
    for i in range(2):
        save(tmp_path / "a" / f"{i}.png", Image.effect_noise((64, 64), 50).convert("L"))
        save(tmp_path / "b" / f"{i}.png", Image.new("L", (64, 64), 3))
    full = (tmp_path / "a" / "1.png").read_bytes()
    (tmp_path / "a" / "1.png").write_bytes(full[: len(full) // 2])  # header intact, data cut
    src = open_source("imagefolder", tmp_path, test_fraction=0.5)
    with pytest.raises(SourceError, match=r"1 unreadable.*a/1\.png"):
        list(src.iter("train")) + list(src.iter("test"))


def test_imagefolder__empty_class_folder_named(tmp_path: Path):
    save(tmp_path / "a" / "1.png", Image.new("L", (2, 2)))
    (tmp_path / "empty_class").mkdir()
    (tmp_path / "empty_class" / "readme.txt").write_text("x")
    with pytest.raises(SourceError, match="empty_class"):
        open_source("imagefolder", tmp_path)


def test_imagefolder__test_class_unknown_to_train(tmp_path: Path):
    save(tmp_path / "train" / "a" / "1.png", Image.new("L", (2, 2)))
    save(tmp_path / "test" / "zebra" / "1.png", Image.new("L", (2, 2)))
    with pytest.raises(SourceError, match="zebra"):
        open_source("imagefolder", tmp_path)


def test_imagefolder__missing_root(tmp_path: Path):
    with pytest.raises(SourceError, match="data.root"):
        open_source("imagefolder", "")


def test_imagefolder__16bit_grey_png_shards_as_128(tmp_path: Path):
    # issue #16: a 4x4 16-bit grey PNG, every pixel 32768, was sharded as 255 (clipped) and its
    # all-grey folder became RGB; 32768 / 65535 of full scale is 128 in 8 bits (32768 >> 8)
    for cls in ("a", "b"):
        for i in range(2):
            path = tmp_path / "raw" / cls / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.frombytes("I;16", (4, 4), np.full((4, 4), 32768, "<u2").tobytes()).save(path)
    with Image.open(tmp_path / "raw" / "a" / "0.png") as im:
        assert im.mode == "I;16"
    params = DataParams(source="imagefolder", root=str(tmp_path / "raw"), test_fraction=0.5,
                        shards_dir=str(tmp_path / "sh"))
    ms = build_all(params, seed=0, progress=False)
    assert ms["train"].mode == "L" and ms["train"].image_shape == (1, 4, 4)
    assert ms["train"].pixel_mean == (round(128 / 255, 6),)
    for split in ("pretrain", "train", "test"):
        for record in iter_shard(tmp_path / "sh" / split / "shard-000000.tar"):
            with Image.open(io.BytesIO(record["png"])) as png:
                assert png.mode == "L"
                assert np.asarray(png).tolist() == [[128] * 4] * 4


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def test_imagefolder__exif_orientation_6__sharded_upright(tmp_path: Path):
    # A phone photo with Orientation 6 ("rotate 90 degrees clockwise to display"). Raw pixels:
    # 3 wide x 2 high, red at raw (x=0, y=0), blue at raw (0, 1), the rest black. Turned 90
    # degrees clockwise the raw left column (red over blue) becomes the top row read right to
    # left: displayed 2 wide x 3 high, blue at (0, 0) and red at the top-right corner (1, 0).
    raw = np.zeros((2, 3, 3), np.uint8)
    raw[0, 0] = (255, 0, 0)
    raw[1, 0] = (0, 0, 255)
    upright = np.zeros((3, 2, 3), np.uint8)  # already upright, no tag: stays as it is
    upright[0, 1] = (255, 0, 0)
    upright[0, 0] = (0, 0, 255)
    for cls in ("a", "b"):
        path = tmp_path / "raw" / cls / "phone.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(raw).save(path, exif=_exif(6))
        Image.fromarray(upright).save(path.with_name("plain.png"))
    with Image.open(tmp_path / "raw" / "a" / "phone.png") as im:
        assert im.size == (3, 2) and im.getexif()[0x0112] == 6

    src = open_source("imagefolder", tmp_path / "raw", test_fraction=0.5, seed=0)
    assert src.native_shape == (3, 3, 2)  # (C, H, W) upright: header sizes are swapped too
    params = DataParams(source="imagefolder", root=str(tmp_path / "raw"), test_fraction=0.5,
                        image_size=0, shards_dir=str(tmp_path / "sh"))
    ms = build_all(params, seed=0, progress=False)
    assert ms["train"].image_shape == (3, 3, 2)
    assert ms["train"].build["exif_orientation"].startswith("applied")
    stored = [png for split in ("train", "test")
              for r in iter_shard(tmp_path / "sh" / split / "shard-000000.tar")
              for png in [Image.open(io.BytesIO(r["png"]))]]
    assert len(stored) == 4
    for png in stored:
        assert png.size == (2, 3)
        assert png.getpixel((1, 0)) == (255, 0, 0)  # the top-right corner
        assert png.getpixel((0, 0)) == (0, 0, 255)
        assert png.getpixel((1, 2)) == (0, 0, 0)


def _tree_with_symlinks(tmp_path: Path) -> Path:
    """root/cats: a, b + sub -> outside/more (m1, m2, m3, deep/d1, deep/loop -> outside/more);
    root/dogs: c + self -> dogs (a loop) + alias -> cats (inside the tree: counted there)."""
    root, outside = tmp_path / "root", tmp_path / "outside" / "more"
    for rel in ("cats/a.png", "cats/b.png", "dogs/c.png"):
        save(root / rel, Image.new("L", (4, 4), 10))
    for rel in ("m1.png", "m2.png", "m3.png", "deep/d1.png"):
        save(outside / rel, Image.new("L", (4, 4), 20))
    (root / "cats" / "sub").symlink_to(outside, target_is_directory=True)
    (outside / "deep" / "loop").symlink_to(outside, target_is_directory=True)
    (root / "dogs" / "self").symlink_to(root / "dogs", target_is_directory=True)
    (root / "dogs" / "alias").symlink_to(root / "cats", target_is_directory=True)
    return root


def test_imagefolder__nested_symlink_and_loops__each_real_directory_once(tmp_path: Path):
    # by hand: cats = a, b + sub/{m1, m2, m3, deep/d1} = 6 (deep/loop is sub again: skipped);
    # dogs = c = 1 (self is dogs itself, alias is cats, already counted) -> 7 images
    root = _tree_with_symlinks(tmp_path)
    src = open_source("imagefolder", root, test_fraction=0.4, seed=0)
    labels = sorted(src.labels("train").tolist() + src.labels("test").tolist())
    assert labels == [0] * 6 + [1]
    # per class round(n * 0.4): cats 2 test + 4 train, dogs 0 test + 1 train
    assert src.splits() == {"pretrain": 5, "train": 5, "test": 2}
    names = sorted(s.key.split("_", 1)[1] for split in ("train", "test")
                   for s in src.iter(split))
    assert names == ["cats_a", "cats_b", "cats_sub_deep_d1", "cats_sub_m1", "cats_sub_m2",
                     "cats_sub_m3", "dogs_c"]
    again = open_source("imagefolder", root, test_fraction=0.4, seed=0)
    assert [s.key for s in again.iter("test")] == [s.key for s in src.iter("test")]


def test_imagefolder__symlink_from_train_into_test__adds_nothing(tmp_path: Path):
    save(tmp_path / "train" / "a" / "1.png", Image.new("L", (4, 4), 1))
    save(tmp_path / "test" / "a" / "2.png", Image.new("L", (4, 4), 2))
    (tmp_path / "train" / "a" / "leak").symlink_to(tmp_path / "test" / "a")
    src = open_source("imagefolder", tmp_path)
    assert src.splits() == {"pretrain": 1, "train": 1, "test": 1}


def test_imagefolder__class_folder_symlink_to_another_class__named(tmp_path: Path):
    save(tmp_path / "a" / "1.png", Image.new("L", (4, 4), 1))
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(SourceError, match=r"/b \(a symlink to a directory counted elsewhere\)"):
        open_source("imagefolder", tmp_path, test_fraction=0.5)
