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
from pipeline.data.sources import SourceError, open_source


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
