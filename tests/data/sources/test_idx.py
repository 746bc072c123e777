"""Fashion-MNIST idx reader on tiny idx files and, when installed, the real Debian files."""

from __future__ import annotations

import gzip
import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
from srchelpers import md5_table

from pipeline.data.sources import FASHION_MNIST_CLASSES, ChecksumError, SourceError, open_source

FASHION_REAL = Path("/usr/share/datasets/fashion-mnist")


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


@pytest.mark.skipif(not FASHION_REAL.is_dir(), reason="dataset-fashion-mnist not installed")
def test_fashion_mnist__samples_pinned_across_refactors():
    # sha256 over (key, label, mode, size, pixels) of capped, shuffled splits, recorded with the
    # single-module sources.py before it became a package (#17): the samples, and so the shards
    # built from them, are unchanged. Independent of the PNG encoder, unlike the shard bytes.
    src = open_source("fashion_mnist")
    digests = {}
    for split, cap in (("train", 100), ("test", 50)):
        h = hashlib.sha256()
        for s in src.iter(split, max_images=cap, seed=0, shuffle=True):
            h.update(f"{s.key} {s.label} {s.image.mode} {s.image.size}\n".encode())
            h.update(s.image.tobytes())
        digests[split] = h.hexdigest()
    assert digests == {
        "train": "77cae09d5f6ab6c21816aa501548c68ac613341af15443750c976b9dda97075e",
        "test": "f31916fceb5e3e9548e7df15e3412356da961465e0bb072a9b51b0a088caf3e4",
    }
