"""STL-10 reader on tiny binaries in the official layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.data.sources import SourceError, open_source


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
