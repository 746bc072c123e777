"""Dataset readers on tiny files written in each source's real on-disk format."""

from __future__ import annotations

import gzip
import hashlib
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.data.sources import (
    FASHION_MNIST_CLASSES,
    Checksum,
    ChecksumError,
    SourceError,
    open_source,
    select_indices,
    verify_file,
)

KEY_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
FASHION_REAL = Path("/usr/share/datasets/fashion-mnist")


def md5_table(directory: Path) -> dict[str, Checksum]:
    return {p.name: Checksum(md5=hashlib.md5(p.read_bytes()).hexdigest())
            for p in directory.iterdir() if p.is_file()}


# --- Fashion-MNIST (idx .gz) -----------------------------------------------------------------


def idx_bytes(array: np.ndarray) -> bytes:
    magic = 0x0800 + array.ndim  # unsigned byte, ndim dimensions (big-endian header)
    return struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape) + \
        array.astype(np.uint8).tobytes()


@pytest.fixture
def tiny_fashion(tmp_path: Path):
    rng = np.random.default_rng(0)
    data = {"train": (rng.integers(0, 256, (6, 28, 28), dtype=np.uint8),
                      np.array([3, 1, 4, 1, 5, 9])),
            "t10k": (rng.integers(0, 256, (4, 28, 28), dtype=np.uint8), np.array([2, 6, 5, 3]))}
    for stem, (images, labels) in data.items():
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            path = tmp_path / f"{stem}-{kind}-ubyte.gz"
            path.write_bytes(gzip.compress(idx_bytes(array), mtime=0))
    return tmp_path, data


def test_fashion_mnist__tiny_idx_files(tiny_fashion):
    root, data = tiny_fashion
    src = open_source("fashion_mnist", root, checksums=md5_table(root))
    assert src.splits() == {"pretrain": 6, "train": 6, "test": 4}
    assert src.class_names == FASHION_MNIST_CLASSES and src.class_names[9] == "Ankle boot"
    assert (src.mode, src.mean, src.std) == ("L", (0.2860,), (0.3530,))
    assert src.native_shape == (1, 28, 28)
    test = list(src.iter("test"))
    assert [s.key for s in test] == ["test_000000", "test_000001", "test_000002", "test_000003"]
    assert [s.label for s in test] == [2, 6, 5, 3]
    assert all(s.image.mode == "L" for s in test)
    np.testing.assert_array_equal(np.asarray(test[2].image), data["t10k"][0][2])
    train = list(src.iter("train"))
    assert train[5].key == "train_000005" and train[5].label == 9
    np.testing.assert_array_equal(np.asarray(train[5].image), data["train"][0][5])


def test_fashion_mnist__published_checksums_reject_other_files(tiny_fashion):
    root, _ = tiny_fashion
    with pytest.raises(ChecksumError, match=r"(t10k|train)-images-idx3-ubyte\.gz"):
        open_source("fashion_mnist", root)


def test_verify_file__accepts_sha256_of_decompressed_content(tmp_path: Path):
    raw = b"idx content " * 100
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(raw, compresslevel=1, mtime=0))  # re-gzipped: md5 differs
    verify_file(path, Checksum(md5="0" * 32, sha256_gunzipped=hashlib.sha256(raw).hexdigest()))
    with pytest.raises(ChecksumError, match=str(path)):
        other = hashlib.sha256(b"other").hexdigest()
        verify_file(path, Checksum(md5="0" * 32, sha256_gunzipped=other))


def test_verify_file__missing_file_named(tmp_path: Path):
    with pytest.raises(SourceError, match="nope.gz"):
        verify_file(tmp_path / "nope.gz", Checksum(md5="0" * 32))


def test_fashion_mnist__missing_files_error(tmp_path: Path):
    with pytest.raises(SourceError, match="not found"):
        open_source("fashion_mnist", tmp_path)


@pytest.mark.skipif(not FASHION_REAL.is_dir(), reason="dataset-fashion-mnist not installed")
def test_fashion_mnist__real_files():
    src = open_source("fashion_mnist")  # published checksums must pass
    assert src.splits() == {"pretrain": 60000, "train": 60000, "test": 10000}
    with gzip.open(FASHION_REAL / "train-labels-idx1-ubyte.gz") as f:
        magic, n = struct.unpack(">II", f.read(8))
        first_label = f.read(1)[0]
    assert (magic, n) == (2049, 60000)
    with gzip.open(FASHION_REAL / "t10k-images-idx3-ubyte.gz") as f:
        magic, n, rows, cols = struct.unpack(">IIII", f.read(16))
        first_test = np.frombuffer(f.read(rows * cols), dtype=np.uint8).reshape(rows, cols)
    assert (magic, n, rows, cols) == (2051, 10000, 28, 28)
    first = next(src.iter("train"))
    assert (first.key, first.label) == ("train_000000", first_label)
    np.testing.assert_array_equal(np.asarray(next(src.iter("test")).image), first_test)


# --- CIFAR (python pickles) ------------------------------------------------------------------


def cifar_rows(hwc: np.ndarray) -> np.ndarray:
    """(N, 32, 32, 3) -> (N, 3072) rows: 1024 red, 1024 green, 1024 blue, row-major."""
    return hwc.transpose(0, 3, 1, 2).reshape(len(hwc), -1)


def dump(path: Path, obj) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))


@pytest.fixture
def tiny_cifar10(tmp_path: Path):
    rng = np.random.default_rng(1)
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    images = rng.integers(0, 256, (13, 32, 32, 3), dtype=np.uint8)
    labels = [7, 1, 2, 3, 4, 5, 6, 0, 8, 9, 2, 4, 6]
    for b in range(5):  # 2 images per train batch
        dump(d / f"data_batch_{b + 1}", {"batch_label": f"training batch {b + 1} of 5",
                                         "labels": labels[2 * b: 2 * b + 2],
                                         "data": cifar_rows(images[2 * b: 2 * b + 2]),
                                         "filenames": ["a.png", "b.png"]})
    dump(d / "test_batch", {"batch_label": "testing batch 1 of 1", "labels": labels[10:],
                            "data": cifar_rows(images[10:]), "filenames": ["c.png"] * 3})
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
             "truck"]
    dump(d / "batches.meta", {"num_cases_per_batch": 2, "label_names": names, "num_vis": 3072})
    return tmp_path, d, images, labels


def test_cifar10__tiny_pickles(tiny_cifar10):
    root, d, images, labels = tiny_cifar10
    src = open_source("cifar10", root, checksums=md5_table(d))
    assert src.splits() == {"pretrain": 10, "train": 10, "test": 3}
    assert src.class_names[7] == "horse" and src.mode == "RGB"
    train = list(src.iter("train"))
    assert [s.label for s in train] == labels[:10]
    assert train[3].key == "train_000003"
    np.testing.assert_array_equal(np.asarray(train[3].image), images[3])
    test = list(src.iter("test"))
    np.testing.assert_array_equal(np.asarray(test[2].image), images[12])
    assert [s.label for s in test] == [2, 4, 6]


def test_cifar10__unverified_file_rejected_before_unpickling(tiny_cifar10, tmp_path: Path):
    root, d, _, _ = tiny_cifar10
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (d / "data_batch_3").write_bytes(pickle.dumps({"data": Evil()}, protocol=2))
    # default table = torchvision's published md5s: every tiny file fails, before unpickling
    with pytest.raises(ChecksumError, match="batches.meta|data_batch"):
        open_source("cifar10", root)
    table = md5_table(d)
    table["data_batch_3"] = Checksum(md5="0" * 32)
    with pytest.raises(ChecksumError, match="data_batch_3"):
        open_source("cifar10", root, checksums=table)
    # even a file whose md5 is trusted may only reference numpy globals
    with pytest.raises(SourceError, match="data_batch_3.*not allowed"):
        open_source("cifar10", root, checksums=md5_table(d))
    assert not marker.exists()


def test_cifar100__tiny_pickles(tmp_path: Path):
    rng = np.random.default_rng(2)
    d = tmp_path / "cifar-100-python"
    d.mkdir()
    images = rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    fine = [99, 0, 42, 7, 13]
    dump(d / "train", {"filenames": ["x"] * 3, "batch_label": "training batch 1 of 1",
                       "fine_labels": fine[:3], "coarse_labels": [1, 2, 3],
                       "data": cifar_rows(images[:3])})
    dump(d / "test", {"filenames": ["x"] * 2, "batch_label": "testing batch 1 of 1",
                      "fine_labels": fine[3:], "coarse_labels": [4, 5],
                      "data": cifar_rows(images[3:])})
    dump(d / "meta", {"fine_label_names": [f"c{i}" for i in range(100)],
                      "coarse_label_names": [f"s{i}" for i in range(20)]})
    src = open_source("cifar100", tmp_path, checksums=md5_table(d))
    assert len(src.class_names) == 100 and src.class_names[42] == "c42"
    assert src.splits() == {"pretrain": 3, "train": 3, "test": 2}
    train = list(src.iter("train"))
    assert [s.label for s in train] == [99, 0, 42]
    np.testing.assert_array_equal(np.asarray(train[2].image), images[2])
    assert src.mean == (0.5071, 0.4865, 0.4409)


# --- STL-10 (binary) -------------------------------------------------------------------------


def test_stl10__tiny_binaries(tmp_path: Path):
    rng = np.random.default_rng(3)
    d = tmp_path / "stl10_binary"
    d.mkdir()
    hwc = {"train": rng.integers(0, 256, (3, 96, 96, 3), dtype=np.uint8),
           "test": rng.integers(0, 256, (2, 96, 96, 3), dtype=np.uint8),
           "unlabeled": rng.integers(0, 256, (2, 96, 96, 3), dtype=np.uint8)}
    for part, imgs in hwc.items():
        # official layout: per image channel-major, each channel column-major (x outer, y inner)
        (d / f"{part}_X.bin").write_bytes(imgs.transpose(0, 3, 2, 1).tobytes())
    (d / "train_y.bin").write_bytes(bytes([1, 10, 4]))
    (d / "test_y.bin").write_bytes(bytes([2, 7]))
    names = ["airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck"]
    (d / "class_names.txt").write_text("\n".join(names) + "\n")

    src = open_source("stl10", tmp_path)
    assert src.splits() == {"pretrain": 5, "train": 3, "test": 2}
    assert src.class_names == tuple(names)
    train = list(src.iter("train"))
    assert [s.label for s in train] == [0, 9, 3]
    # reference: torchvision's reader = reshape (-1, 3, 96, 96) then swap the last two axes
    raw = np.frombuffer((d / "train_X.bin").read_bytes(), dtype=np.uint8)
    chw = np.transpose(raw.reshape(-1, 3, 96, 96), (0, 1, 3, 2))
    np.testing.assert_array_equal(np.asarray(train[1].image).transpose(2, 0, 1), chw[1])
    np.testing.assert_array_equal(np.asarray(train[1].image), hwc["train"][1])
    pretrain = list(src.iter("pretrain"))
    assert [s.key for s in pretrain] == ["train_000000", "train_000001", "train_000002",
                                         "unlabeled_000000", "unlabeled_000001"]
    assert [s.label for s in pretrain] == [0, 9, 3, -1, -1]
    np.testing.assert_array_equal(np.asarray(pretrain[4].image), hwc["unlabeled"][1])


def test_stl10__truncated_binary_named(tmp_path: Path):
    d = tmp_path
    for part in ("train", "test", "unlabeled"):
        (d / f"{part}_X.bin").write_bytes(bytes(3 * 96 * 96))
    (d / "train_X.bin").write_bytes(bytes(3 * 96 * 96 - 5))
    (d / "train_y.bin").write_bytes(bytes([1]))
    (d / "test_y.bin").write_bytes(bytes([1]))
    (d / "class_names.txt").write_text("\n".join("abcdefghij"))
    with pytest.raises(SourceError, match="train_X.bin"):
        open_source("stl10", tmp_path)


# --- ImageFolder -----------------------------------------------------------------------------


def save(path: Path, image: Image.Image, fmt: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format=fmt)


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
        open_source("imagefolder", tmp_path, test_fraction=0.5)


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


# --- caps and factory ------------------------------------------------------------------------


def test_select_indices__stratified_and_seeded():
    labels = np.array([0] * 80 + [1] * 20)
    idx = select_indices(labels, 10, seed=0)
    assert np.bincount(labels[idx]).tolist() == [8, 2]
    assert list(idx) == sorted(idx) and len(set(idx)) == 10
    assert list(idx) == list(select_indices(labels, 10, seed=0))
    assert set(idx) != set(select_indices(labels, 10, seed=1))
    assert len(select_indices(labels, 0, seed=0)) == 100
    # remainders: 7 of (5, 3, 2) -> exact 3.5, 2.1, 1.4 -> floors 3, 2, 1 + 1 for the largest (0)
    three = np.array([0] * 5 + [1] * 3 + [2] * 2)
    assert np.bincount(three[select_indices(three, 7, seed=0)]).tolist() == [4, 2, 1]


def test_source__max_images_and_shuffle(tiny_fashion):
    root, _ = tiny_fashion
    src = open_source("fashion_mnist", root, checksums=md5_table(root))
    keys = [s.key for s in src.iter("train", max_images=4, seed=5)]
    assert len(keys) == 4 and keys == sorted(keys)
    shuffled = [s.key for s in src.iter("train", max_images=4, seed=5, shuffle=True)]
    assert sorted(shuffled) == keys


def test_open_source__unknown_name():
    with pytest.raises(ValueError, match="unknown data source 'mnist'.*fashion_mnist.*imagefolder"):
        open_source("mnist")
