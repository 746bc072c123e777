"""Fixtures shared by the source tests."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from srchelpers import idx_bytes


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
