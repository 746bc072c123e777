"""Labelled WebDataset shards as the labelled source (``data.source: webdataset``)."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from helpers import img2dataset_shards
from PIL import Image

from pipeline.data.index import index_shards
from pipeline.data.manifest import LabelSummary
from pipeline.data.sources import SourceError, open_source
from pipeline.data.sources.webdataset import split_sizes


def test_webdataset_source__cls_labels_split_per_class(tmp_path):
    img2dataset_shards(tmp_path / "lab", shards=2, per_shard=20, cls=(0, 1), colour=False)
    src = open_source("webdataset", f"{tmp_path}/lab/{{00000..00001}}.tar", test_fraction=0.25,
                      seed=0)
    assert src.class_names == ("0", "1", "2", "3") and src.mode == "L"
    assert src.native_shape == (1, 16, 16)
    # 10 per class; round(10 * 0.25) = 2 (int(2.5 + 0.5) = 3) test images per class
    assert np.bincount(src.labels("test")).tolist() == [3, 3, 3, 3]
    assert np.bincount(src.labels("train")).tolist() == [7, 7, 7, 7]
    assert src.count("pretrain") == src.count("train") == 28
    s = next(src.iter("test"))
    assert s.image.mode == "L" and s.image.size == (16, 16) and 0 <= s.label < 4


def test_webdataset_source__json_field_string_labels_unlabelled_to_pretrain(tmp_path):
    paths = img2dataset_shards(tmp_path / "lab", shards=1, per_shard=12)
    # drop the .json of two samples: they have no label and only join pretraining
    with tarfile.open(paths[0]) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    with tarfile.open(paths[0], "w") as t:
        for m, data in members:
            if m.name in ("000000000.json", "000000001.json"):
                continue
            t.addfile(m, io.BytesIO(data))
    src = open_source("webdataset", str(tmp_path / "lab"), label_field="name",
                      test_fraction=0.34, seed=1)
    assert src.class_names == ("a", "b", "c", "d") and src.mode == "RGB"
    assert src.count("train") + src.count("test") == 10
    assert src.count("pretrain") == src.count("train") + 2
    assert (src.labels("pretrain") == -1).sum() == 2


def test_webdataset_source__bad_labels_and_missing_shards_one_line(tmp_path):
    path = tmp_path / "lab" / "00000.tar"
    path.parent.mkdir()
    with tarfile.open(path, "w") as t:
        for key, label in (("a", 1), ("b", "cat")):
            buf = io.BytesIO()
            Image.new("L", (8, 8)).save(buf, format="PNG")
            for ext, data in (("png", buf.getvalue()), ("json", json.dumps({"y": label}).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    with pytest.raises(SourceError, match="labels are integers and strings mixed"):
        open_source("webdataset", str(path.parent), label_field="y")
    with pytest.raises(SourceError, match="no labelled sample"):
        open_source("webdataset", str(path.parent), label_field="cls")
    with pytest.raises(SourceError, match="no shards found"):
        open_source("webdataset", f"{tmp_path}/nothing-*.tar")


def test_webdataset_source__uses_the_stage_index_and_its_broken_keys(tmp_path):
    img2dataset_shards(tmp_path / "lab", shards=1, per_shard=20, cls=(0,), broken={0: 1})
    spec = str(tmp_path / "lab")
    index, _ = index_shards(spec, split="labelled", key="data.root", max_broken_fraction=0.1)
    src = open_source("webdataset", spec, index=index, test_fraction=0.2)
    assert src.count("train") + src.count("test") == 19
    with pytest.raises(SourceError, match="0.1 %"):  # the budget, when it indexes itself
        open_source("webdataset", spec, max_broken_fraction=0.001)


# --- the labels as index_shards reads them, before build_shards ------------------------------


def labelled_tar(path, samples):
    """A shard of 8 px grey PNGs; ``samples`` = ``[(key, {ext: bytes})]`` beside each image."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
        for key, extra in samples:
            buf = io.BytesIO()
            Image.new("L", (8, 8), len(key) * 20).save(buf, format="PNG")
            for ext, data in (("png", buf.getvalue()), *extra.items()):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return path


def cls(y):
    return {"cls": str(y).encode()}


def js(**fields):
    return {"json": json.dumps(fields).encode()}


def test_sample_label__below_minus_one_names_the_key_and_the_param():
    from pipeline.data.external import sample_label

    with pytest.raises(ValueError) as e:
        sample_label({"__key__": "k7", "cls": b"-5"}, "cls")
    assert str(e.value) == ("sample 'k7': label -5 is below -1 (-1 = unlabelled; "
                            "data.label_field 'cls')")
    with pytest.raises(ValueError, match=r"sample 'k': label -2 is below -1 .*'y'\)"):
        sample_label({"__key__": "k", "json": b'{"y": -2}'}, "y")
    assert sample_label({"__key__": "k", "cls": b"-1"}, "cls") == -1  # unlabelled


def test_index_labels__summary_per_shard_by_hand(tmp_path):
    # shard 0: classes 0, 0, 2 and one sample without .cls; shard 1: class 1 and a -1
    labelled_tar(tmp_path / "lab" / "00000.tar",
                 [("a0", cls(0)), ("a1", cls(0)), ("a2", {}), ("a3", cls(2))])
    labelled_tar(tmp_path / "lab" / "00001.tar", [("b0", cls(-1)), ("b1", cls(1))])
    m, _ = index_shards(str(tmp_path / "lab"), split="labelled", key="data.root",
                        max_broken_fraction=0, label_field="cls")
    assert [s.labels for s in m.shards] == [
        LabelSummary(kind="int", counts={"0": 2, "2": 1}, unlabelled=1, first=("a0", 0)),
        LabelSummary(kind="int", counts={"1": 1}, unlabelled=1, first=("b1", 1))]
    assert m.build["label_field"] == "cls"
    # classes 0..2 with 2, 1, 1 samples at test_fraction 0.5: int(n/2 + 0.5) = 1, 1, 1 test
    assert split_sizes(m, 0.5, "lab") == {"train": 1, "test": 3, "pretrain": 3}
    src = open_source("webdataset", str(tmp_path / "lab"), test_fraction=0.5, index=m)
    assert (src.count("train"), src.count("test"), src.count("pretrain")) == (1, 3, 3)
    with pytest.raises(SourceError) as e:
        split_sizes(m, 0.2, "lab")  # int(n x 0.2 + 0.5) = 0 for n <= 2
    assert str(e.value) == ("data.root = 'lab': data.test_fraction=0.2 leaves the test split "
                            "empty")


@pytest.mark.parametrize(("shards", "field", "want"), [
    # a .cls below -1: the shard, the key, the value and the param
    ([[("a0", cls(1)), ("a1", cls(-5))]], "cls",
     "{0}: sample 'a1': label -5 is below -1 (-1 = unlabelled; data.label_field 'cls')"),
    # a label that is no integer nor string
    ([[("a0", js(y=1.5))]], "y",
     "{0}: sample 'a0': .json field 'y' is 1.5, not an integer or a string (data.label_field "
     "'y')"),
    ([[("a0", cls("cat"))]], "cls",
     "{0}: sample 'a0': .cls is not an integer (data.label_field 'cls')"),
    # integers and strings in one shard, then in two
    ([[("a0", js(y=3)), ("a1", js(y="cat"))]], "y",
     "{0}: labels are integers and strings mixed: sample 'a0' has 3, sample 'a1' 'cat' "
     "(data.label_field 'y')"),
    ([[("a0", js(y=3))], [("b0", js()), ("b1", js(y="cat"))]], "y",
     "{0}: sample 'a0' has 3, {1}: sample 'b1' 'cat': labels are integers and strings mixed "
     "(data.label_field 'y')"),
    # no label at all
    ([[("a0", js(z=1))]], "y",
     "data.root = '{dir}': no labelled sample (data.label_field 'y'); data.source none "
     "pretrains without labels"),
])
def test_index_labels__what_the_build_refuses_named_in_one_line(tmp_path, shards, field, want):
    from pipeline.data.shards import ShardError

    paths = [labelled_tar(tmp_path / "lab" / f"{i:05d}.tar", s) for i, s in enumerate(shards)]
    with pytest.raises(ShardError) as e:
        index_shards(str(tmp_path / "lab"), split="labelled", key="data.root",
                     max_broken_fraction=0, label_field=field)
    assert str(e.value) == want.format(*paths, dir=tmp_path / "lab")


def test_index_labels__another_label_field_reads_every_shard_again(tmp_path, monkeypatch):
    import pipeline.data.index as index_mod

    labelled_tar(tmp_path / "lab" / "00000.tar", [("a0", {**cls(1), **js(name="dog")})])
    spec = str(tmp_path / "lab")
    m, val = index_shards(spec, split="labelled", key="data.root", max_broken_fraction=0,
                          label_field="cls")
    reads = []
    real = index_mod._read_shard
    monkeypatch.setattr(index_mod, "_read_shard",
                        lambda url, *a: reads.append(url) or real(url, *a))
    same, _ = index_shards(spec, split="labelled", key="data.root", max_broken_fraction=0,
                           label_field="cls", previous=m, validators=val)
    assert reads == [] and same == m
    other, _ = index_shards(spec, split="labelled", key="data.root", max_broken_fraction=0,
                            label_field="name", previous=m, validators=val)
    assert reads == [str(tmp_path / "lab" / "00000.tar")]
    assert other.shards[0].labels.counts == {"dog": 1}


def _reference_split(items, num_classes, test_fraction, seed):
    """The per-class split written the slow, obvious way: a list per class, sorted, permuted."""
    rng = np.random.default_rng([seed, 2])
    by_class = [sorted(it for it in items if it[1] == c) for c in range(num_classes)]
    out = {"train": [], "test": []}
    for members in by_class:
        n_test = int(len(members) * test_fraction + 0.5)
        perm = rng.permutation(len(members))
        out["test"] += [members[i] for i in perm[:n_test]]
        out["train"] += [members[i] for i in perm[n_test:]]
    return out


@pytest.mark.parametrize("seed", [0, 3])
def test_split_positions__equals_the_list_per_class_reference(seed):
    from pipeline.data.sources.imagefolder import split_per_class, split_positions

    labels = np.random.default_rng(seed).integers(-1, 5, size=300)  # class 5 empty, -1 left out
    got = split_positions(labels, 6, 0.3, seed)
    want = _reference_split([(i, int(y)) for i, y in enumerate(labels) if y >= 0], 6, 0.3, seed)
    assert {k: v.tolist() for k, v in got.items()} == {k: [i for i, _ in v]
                                                       for k, v in want.items()}
    files = [(f"c{y}/{i:04d}.png", int(y)) for i, y in enumerate(labels) if y >= 0][::-1]
    assert split_per_class(files, 6, 0.3, seed) == _reference_split(files, 6, 0.3, seed)


def test_webdataset_source__images_kept_on_disk_not_in_memory(tmp_path):
    import tracemalloc

    paths = img2dataset_shards(tmp_path / "lab", shards=2, per_shard=30, cls=(0, 1),
                               colour=True, size=64)
    image_bytes = 0
    for p in paths:
        with tarfile.open(p) as t:
            image_bytes += sum(m.size for m in t.getmembers() if m.name.endswith(".jpg"))
    tracemalloc.start()
    src = open_source("webdataset", str(tmp_path / "lab"), test_fraction=0.25, seed=0)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert image_bytes > 60 * 1000 and held < image_bytes / 4  # 60 images of >1 kB kept on disk
    with tarfile.open(paths[1]) as t:  # the bytes come back as the shard holds them
        jpg = {m.name[:-4]: t.extractfile(m).read() for m in t.getmembers()
               if m.name.endswith(".jpg")}
    samples = [s for s in src.iter("pretrain") if s.key.split("_", 1)[1] in jpg]
    assert samples and all(s.file.data == jpg[s.key.split("_", 1)[1]] for s in samples)
