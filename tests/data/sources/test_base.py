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


def test_name_bad_files__names_ten_counts_the_rest_and_logs_all(caplog):
    from pipeline.data.sources.base import MAX_NAMED, name_bad_files

    assert MAX_NAMED == 10
    few = [f"/d/{i}.jpg (OSError)" for i in range(10)]
    assert name_bad_files("unreadable image(s)", few) == (
        "10 unreadable image(s): /d/0.jpg (OSError); /d/1.jpg (OSError); /d/2.jpg (OSError); "
        "/d/3.jpg (OSError); /d/4.jpg (OSError); /d/5.jpg (OSError); /d/6.jpg (OSError); "
        "/d/7.jpg (OSError); /d/8.jpg (OSError); /d/9.jpg (OSError)")
    assert not caplog.records  # all named in the line: nothing logged
    many = [f"/d/{i}.jpg (OSError)" for i in range(13)]
    assert name_bad_files("unreadable image(s)", many) == (
        "13 unreadable image(s): /d/0.jpg (OSError); /d/1.jpg (OSError); /d/2.jpg (OSError); "
        "/d/3.jpg (OSError); /d/4.jpg (OSError); /d/5.jpg (OSError); /d/6.jpg (OSError); "
        "/d/7.jpg (OSError); /d/8.jpg (OSError); /d/9.jpg (OSError); ... and 3 more "
        "(all 13 logged above)")
    assert [r.getMessage() for r in caplog.records] == [
        f"unreadable image: /d/{i}.jpg (OSError)" for i in range(13)]


def test_shown_path__odd_names_as_bytes_literals():
    from pipeline.data.sources.base import shown_path

    assert shown_path("/d/two words/café.jpg") == "/d/two words/café.jpg"
    assert shown_path("/d/a\nb.jpg") == "b'/d/a\\nb.jpg'"
    latin1 = b"/d/caf\xe9.jpg".decode("utf-8", "surrogateescape")  # as os.listdir gives it
    assert shown_path(latin1) == "b'/d/caf\\xe9.jpg'"
