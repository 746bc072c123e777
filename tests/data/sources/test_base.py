"""The shared base: class-stratified caps and seeded visiting order."""

from __future__ import annotations

import numpy as np
from srchelpers import md5_table

from pipeline.data.sources import open_source, select_indices


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
