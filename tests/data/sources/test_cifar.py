"""CIFAR-10/100 reader on tiny pickle batches, and the verify-before-unpickle guard."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from srchelpers import md5_table

from pipeline.data.sources import Checksum, ChecksumError, SourceError, open_source


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
