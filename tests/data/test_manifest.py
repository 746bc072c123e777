"""The typed manifest: its one writer writes the bytes the hand-built dicts wrote, and reads back.

``golden/*.json`` were written by the code before :class:`Manifest` existed (``write_shards``,
``empty_split`` and ``index_shards`` + ``write_json`` on the same tiny inputs as below), so
these tests prove that the typed writer writes byte for byte what the old one did: the shards'
manifests, DVC's hashes of them and the resume fingerprint stay as they were.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import img2dataset_shards, make_samples

from pipeline.data.build import empty_split, write_shards
from pipeline.data.index import index_shards, pretrain_manifest
from pipeline.data.manifest import (
    MANIFEST_NAME,
    LabelSummary,
    Manifest,
    ShardEntry,
    ShardError,
    read_manifest,
    write_manifest,
)

GOLDEN = Path(__file__).parent / "golden"


def own_split(root: Path) -> Path:
    """Our own build of 10 samples, 4 per shard (``golden/own.json``)."""
    write_shards(make_samples(10, size=8, seed=0), root / "own", split="train",
                 source="synthetic", class_names=["a", "b", "c", "d"], mode="L",
                 samples_per_shard=4, build={"seed": 0, "max_images": 0}, progress=False)
    return root / "own"


def empty(root: Path) -> Path:
    """A split without images (``golden/empty.json``)."""
    empty_split(root / "empty", split="test", source="none", class_names=(), mode="L",
                build={"seed": 0})
    return root / "empty"


def index(root: Path) -> Path:
    """The index of 2 img2dataset shards with labels, one sample broken (``golden/index.json``).

    Run from ``root`` with relative paths, so the entries' ``url`` are those of the golden file.
    """
    img2dataset_shards(Path("ext"), shards=2, per_shard=5, broken={1: 1}, cls=(0, 1))
    m, _ = index_shards("ext", split="labelled", key="data.root", max_broken_fraction=0.5,
                        label_field="cls")
    write_manifest(m, root / "index")
    return root / "index"


WRITERS = {"own": own_split, "empty": empty, "index": index}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_write_manifest__golden_bytes(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    split = WRITERS[name](tmp_path)
    assert (split / MANIFEST_NAME).read_bytes() == (GOLDEN / f"{name}.json").read_bytes()


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_read_then_write__byte_identical(tmp_path, name):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / MANIFEST_NAME).write_bytes((GOLDEN / f"{name}.json").read_bytes())
    m = read_manifest(tmp_path / "in")
    write_manifest(m, tmp_path / "out")
    assert (tmp_path / "out" / MANIFEST_NAME).read_bytes() == (
        GOLDEN / f"{name}.json").read_bytes()
    assert read_manifest(tmp_path / "out") == m


def test_read_manifest__fields_are_attributes():
    own = read_manifest_of("own")
    assert (own.source, own.split, own.num_samples, own.mode) == ("synthetic", "train", 10, "L")
    assert own.class_names == ("a", "b", "c", "d") and own.image_shape == (1, 8, 8)
    assert own.samples_per_shard == 4 and own.num_broken is None
    assert [(s.name, s.num_samples, s.url, s.read_layout) for s in own.shards] == [
        ("shard-000000.tar", 4, None, "pipeline"), ("shard-000001.tar", 4, None, "pipeline"),
        ("shard-000002.tar", 2, None, "pipeline")]
    assert own.label_counts == {"0": 3, "1": 3, "2": 2, "3": 2} and own.build == {
        "seed": 0, "max_images": 0}
    idx = read_manifest_of("index")
    assert (idx.num_samples, idx.num_broken, idx.samples_per_shard) == (9, 1, None)
    first, second = idx.shards
    assert (first.url, first.layout, first.name) == ("ext/00000.tar", "webdataset", None)
    assert [b.key for b in second.broken] == ["000010000"] and first.broken == ()
    assert first.stats is not None and first.stats.pixels == 5 * 16 * 16
    assert first.labels == LabelSummary(kind="int", counts={"0": 2, "1": 1, "2": 1, "3": 1},
                                        unlabelled=0, first=("000000000", 0))
    none = read_manifest_of("empty")
    assert none.image_shape is None and none.shards == () and none.pixel_mean == ()


def read_manifest_of(name: str) -> Manifest:
    return Manifest.from_dict(json.loads((GOLDEN / f"{name}.json").read_text()))


def test_to_dict__absent_keys_stay_absent_unknown_keys_kept(tmp_path):
    d = {"format": "moco-pipeline-shards/1", "source": "s", "split": "train",
         "num_samples": 3, "mode": "L", "class_names": ["a"], "mean": [0.5], "std": [0.25],
         "image_shape": None, "future_field": {"x": 1},
         "shards": [{"name": "shard-000000.tar", "num_samples": 3, "bytes": 10,
                     "sha256": "ab", "note": "kept"}]}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(d))
    m = read_manifest(tmp_path)
    assert m.build is None and m.label_counts is None and m.pixel_mean is None
    assert m.extra == {"future_field": {"x": 1}} and m.shards[0].extra == {"note": "kept"}
    assert m.to_dict() == d


def test_pretrain_manifest__joined_entries_keep_their_name_and_gain_url_and_layout(tmp_path):
    write_shards(make_samples(6, size=16), tmp_path / "sh" / "pretrain", split="pretrain",
                 source="synthetic", class_names=["a", "b", "c", "d"], mode="L",
                 samples_per_shard=4, progress=False)
    write_shards(make_samples(4, size=16, seed=1), tmp_path / "sh" / "train", split="train",
                 source="synthetic", class_names=["a", "b", "c", "d"], mode="L",
                 samples_per_shard=4, progress=False)
    img2dataset_shards(tmp_path / "ext", shards=1, per_shard=3)
    m, _ = index_shards(str(tmp_path / "ext"), split="pretrain", key="k", max_broken_fraction=0)
    joined = pretrain_manifest(tmp_path / "sh", write_index(m, tmp_path / "idx"))
    built = joined.shards[0]
    assert (built.name, built.url, built.layout) == (
        "shard-000000.tar", str(tmp_path / "sh" / "pretrain" / "shard-000000.tar"), "pipeline")
    assert json.loads(joined.to_json())["shards"][0] == {
        "name": "shard-000000.tar", "url": built.url, "layout": "pipeline",
        "num_samples": 4, "bytes": built.bytes, "sha256": built.sha256}


def write_index(m: Manifest, directory: Path) -> Path:
    write_manifest(m, directory)
    return directory


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(num_samples=11), "'num_samples' != sum of the shards' num_samples"),
    (lambda d: d.pop("mode"), "'mode' missing or not a str"),
    (lambda d: d.update(format="other/1"), "'format' must be 'moco-pipeline-shards/1'"),
    (lambda d: d["shards"][0].update(name="x.tar"), "shards[0].name invalid"),
    (lambda d: d["shards"][0].pop("sha256"), "shards[0] needs 'bytes' and 'sha256'"),
])
def test_read_manifest__bad_manifest_one_line_naming_the_file(tmp_path, change, message):
    d = json.loads((GOLDEN / "own.json").read_text())
    change(d)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ShardError) as e:
        read_manifest(tmp_path)
    assert str(e.value) == f"{tmp_path / MANIFEST_NAME}: invalid manifest: {message}"


def test_read_manifest__malformed_index_entry_is_a_shard_error(tmp_path):
    d = json.loads((GOLDEN / "index.json").read_text())
    d["shards"][1]["broken"] = [{"key": "k"}]  # no "why"
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ShardError, match=r"manifest.json: invalid manifest: .*broken"):
        read_manifest(tmp_path)


def test_manifest__frozen_and_replace_keeps_the_rest():
    m = read_manifest_of("own")
    with pytest.raises(AttributeError):
        m.num_samples = 3  # type: ignore[misc]
    entry = ShardEntry(name="shard-000000.tar", num_samples=1, bytes=2, sha256="c")
    m2 = replace(m, shards=(entry,), num_samples=1)
    assert m2.class_names == m.class_names and m2.build == m.build
    assert m2.to_dict()["shards"] == [{"name": "shard-000000.tar", "num_samples": 1,
                                        "bytes": 2, "sha256": "c"}]
