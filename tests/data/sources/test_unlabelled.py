"""The unlabelled tree: what is an image, what is skipped and counted, and the pretrain mix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from srchelpers import KEY_CHARS, md5_table, save

from pipeline.data.sources import SourceError, open_source
from pipeline.data.sources.unlabelled import (
    NoLabelsSource,
    PretrainMix,
    UnlabelledTree,
    walk_images,
)


def grey(v: int, size=(8, 8)) -> Image.Image:
    return Image.new("L", size, v)


def test_walk_images__nesting_sorted_and_skips_counted_by_reason(tmp_path):
    save(tmp_path / "b" / "c" / "deep.PNG", grey(1))
    save(tmp_path / "a.jpg", grey(2), "JPEG")
    save(tmp_path / "b" / "x.webp", Image.new("RGB", (8, 8)))
    (tmp_path / "._a.jpg").write_bytes(b"\0\5\26\7")  # AppleDouble (also a dot file)
    (tmp_path / ".DS_Store").write_bytes(b"x")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "hidden.png").write_bytes(b"never read")  # inside a hidden folder
    (tmp_path / "b" / "notes.txt").write_text("x")
    (tmp_path / "b" / "meta.json").write_text("{}")
    paths, skipped = walk_images(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in map(type(tmp_path), paths)] == [
        "a.jpg", "b/c/deep.PNG", "b/x.webp"]
    assert dict(skipped) == {"appledouble": 1, "hidden": 2, "not_image": 2}


def test_unlabelled_tree__keys_labels_and_record(tmp_path):
    save(tmp_path / "z" / "two words.png", grey(10))
    save(tmp_path / "a.png", grey(20))
    (tmp_path / "README.txt").write_text("x")
    tree = UnlabelledTree(tmp_path)
    s0, s1 = tree.load(0, "L"), tree.load(1, "L")
    assert (s0.key, s0.label, s0.image.getpixel((0, 0))) == ("u0000000_a", -1, 20)
    assert (s1.key, s1.label) == ("u0000001_z_two_words", -1)
    assert set(s1.key) <= KEY_CHARS
    assert tree.build_record() == {
        "root": str(tmp_path), "images": 2,
        "exif_orientation": "applied (PIL ImageOps.exif_transpose, before resize/crop)"}
    assert tree.describe_skipped() == "1 not_image"


def test_unlabelled_tree__unreadable_header_one_line_naming_the_file(tmp_path):
    save(tmp_path / "ok.png", grey(1))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "broken.jpg").write_bytes(b"not a jpeg at all")
    with pytest.raises(SourceError) as e:
        UnlabelledTree(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "1 unreadable image(s)" in msg and "sub/broken.jpg" in msg


def test_unlabelled_tree__empty_or_missing_refused(tmp_path):
    (tmp_path / "README.txt").write_text("x")
    with pytest.raises(SourceError, match=r"no images .*\(skipped: 1 not_image\)"):
        UnlabelledTree(tmp_path)
    with pytest.raises(SourceError, match="not a directory"):
        UnlabelledTree(tmp_path / "missing")


def test_pretrain_mix__labels_order_and_one_mode(tmp_path, tiny_fashion):
    root, data = tiny_fashion
    save(tmp_path / "t" / "c.png", Image.new("RGB", (28, 28), (255, 0, 0)))
    save(tmp_path / "t" / "g.png", grey(7, (28, 28)))
    fm = open_source("fashion_mnist", root, checksums=md5_table(root))
    mix = PretrainMix(fm, UnlabelledTree(tmp_path / "t"), include_labelled=True, resized=False)
    # 6 labelled train images, then the tree's two with -1; train/test are the source's
    assert mix.labels("pretrain").tolist() == [3, 1, 4, 1, 5, 9, -1, -1]
    assert mix.labels("test").tolist() == [2, 6, 5, 3]
    # one colour image: everything RGB, the Fashion-MNIST grey as three equal channels, and
    # the published one-channel statistics no longer apply (pixel statistics instead)
    assert mix.mode == "RGB" and mix.mean is None
    first = next(mix.iter("pretrain"))
    a = np.asarray(first.image)
    assert first.image.mode == "RGB" and (a[..., 0] == a[..., 2]).all()
    assert np.array_equal(a[..., 0], data["train"][0][0])
    red = [s for s in mix.iter("pretrain") if s.label == -1][0]
    assert red.image.getpixel((0, 0)) == (255, 0, 0)
    assert next(mix.iter("test")).image.mode == "RGB"


def test_pretrain_mix__tree_alone_and_grey_keeps_published_stats(tmp_path, tiny_fashion):
    root, _ = tiny_fashion
    save(tmp_path / "t" / "g.png", grey(7, (28, 28)))
    fm = open_source("fashion_mnist", root, checksums=md5_table(root))
    mix = PretrainMix(fm, UnlabelledTree(tmp_path / "t"), include_labelled=False, resized=False)
    assert mix.labels("pretrain").tolist() == [-1]
    assert mix.mode == "L" and mix.mean == fm.mean and mix.count("train") == 6


def test_pretrain_mix__sizes_stored_as_they_are_must_be_one_square(tmp_path, tiny_fashion):
    root, _ = tiny_fashion
    save(tmp_path / "t" / "a.png", grey(7, (28, 28)))
    save(tmp_path / "t" / "b.png", grey(7, (40, 30)))
    fm = open_source("fashion_mnist", root, checksums=md5_table(root))
    tree = UnlabelledTree(tmp_path / "t")
    with pytest.raises(SourceError, match=r"28x28, 40x30 px and data.image_size is 0.*"
                                          r"set data.image_size"):
        PretrainMix(fm, tree, include_labelled=True, resized=False)
    PretrainMix(fm, tree, include_labelled=True, resized=True)  # resized when sharding: fine


def test_no_labels_source__every_split_empty():
    src = NoLabelsSource()
    assert src.splits() == {"pretrain": 0, "train": 0, "test": 0} and src.class_names == ()


def test_walk_images__symlinked_folders_once_and_loops_end(tmp_path):
    # worked by hand: real a/ (2 images) and b/ (1); link/ -> b (already counted: adds nothing),
    # b/loop -> the tree's top (a loop: ends), ext -> an outside folder with 1 image (counted)
    save(tmp_path / "t" / "a" / "1.png", grey(1))
    save(tmp_path / "t" / "a" / "2.png", grey(2))
    save(tmp_path / "t" / "b" / "3.png", grey(3))
    save(tmp_path / "outside" / "4.png", grey(4))
    (tmp_path / "t" / "link").symlink_to(tmp_path / "t" / "b", target_is_directory=True)
    (tmp_path / "t" / "b" / "loop").symlink_to(tmp_path / "t", target_is_directory=True)
    (tmp_path / "t" / "ext").symlink_to(tmp_path / "outside", target_is_directory=True)
    paths, _ = walk_images(tmp_path / "t")
    rel = [str(Path(p).relative_to(tmp_path / "t")) for p in paths]
    assert rel == ["a/1.png", "a/2.png", "b/3.png", "ext/4.png"]


def test_unlabelled_tree__exif_orientation_6_loaded_upright(tmp_path):
    # raw 3 x 2 pixels (W x H) tagged Orientation 6: shown rotated 90 degrees clockwise, 2 x 3;
    # the raw top-left pixel (value 10) lands at the displayed top-right corner (x=1, y=0)
    raw = np.array([[10, 20, 30], [40, 50, 60]], dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(raw).save(tmp_path / "photo.jpg", exif=exif, quality=100)
    tree = UnlabelledTree(tmp_path)
    assert tree.sizes == {(2, 3)}
    img = tree.load(0, "L").image
    assert img.size == (2, 3) and abs(img.getpixel((1, 0)) - 10) <= 3


def test_describe_skipped__one_wording_for_index_and_build():
    from pipeline.data.sources.unlabelled import describe_skipped

    assert describe_skipped({"not_image": 3, "appledouble": 2, "hidden": 0}) == (
        "2 appledouble, 3 not_image")  # SKIP_REASONS order, zero counts left out
    assert describe_skipped({}) == "none"
