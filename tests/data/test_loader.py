"""Train loader (equal batches per rank, seeded, resumable) and eval loader (exactly once)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from helpers import relabel_first_sample, rewrite_manifest
from PIL import Image

from pipeline.data.loader import eval_loader, read_manifest, train_loader
from pipeline.data.shards import ShardError, write_shards
from pipeline.data.sources import Sample

# 3 workers on this 2-core machine is deliberate (more workers than shards)
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def make_shards(directory: Path, n: int, per_shard: int) -> Path:
    """n 4x4 grey images whose every pixel equals the sample index (its identity)."""
    items = [Sample(f"k{i:03d}", Image.new("L", (4, 4), i), i % 3) for i in range(n)]
    write_shards(items, directory, split="pretrain", source="toy", class_names=["a", "b", "c"],
                 mode="L", samples_per_shard=per_shard, progress=False)
    return directory


def two_crop(img: Image.Image, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q = the raw pixels (identifies the sample), k = the seed folded into a float."""
    q = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).view(1, 4, 4)
    return q, torch.full((1, 4, 4), float(seed % 1_000_003))


def ids(batches) -> list[list[int]]:
    return [b[0][:, 0, 0, 0].long().tolist() for b in batches]


def load(d: Path, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    args = dict(transform=two_crop, batch_size=4, steps=7, epoch=0, seed=0)
    args.update(kw)
    return list(train_loader(d, **args))


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                    for x, y in zip(a, b))


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("uneven") / "s", n=12, per_shard=5)  # 5, 5, 2


def test_train_loader__equal_batches_across_ranks(uneven: Path):
    assert [s["num_samples"] for s in read_manifest(uneven)["shards"]] == [5, 5, 2]
    per_rank = [load(uneven, rank=r, world_size=2, num_workers=w) for r in (0, 1) for w in (0, 2)]
    for batches in per_rank:
        assert len(batches) == 7
        assert all(q.shape == k.shape == (4, 1, 4, 4) for q, k in batches)
        assert all(0 <= i < 12 for b in ids(batches) for i in b)
    assert ids(per_rank[0]) != ids(per_rank[2])  # ranks draw different streams


def test_train_loader__more_workers_than_shards(tmp_path: Path):
    d = make_shards(tmp_path / "s", n=6, per_shard=10)  # one shard
    assert len(load(d, num_workers=3, steps=5)) == 5
    assert len(load(d, num_workers=3, steps=2)) == 2  # also fewer batches than workers
    loader = train_loader(d, transform=two_crop, batch_size=4, steps=5, epoch=0, seed=0,
                          num_workers=3)
    assert len(loader) == 5


def test_train_loader__same_epoch_same_batches(uneven: Path):
    a, b = load(uneven, num_workers=2), load(uneven, num_workers=2)
    assert same(a, b)
    loader = train_loader(uneven, transform=two_crop, batch_size=4, steps=7, epoch=0, seed=0)
    assert same(list(loader), list(loader))  # re-iterating the same object, in-process
    assert same(list(loader), load(uneven, num_workers=0))


def test_train_loader__epoch_and_seed_change_order(uneven: Path):
    e0, e1 = load(uneven, epoch=0), load(uneven, epoch=1)
    assert ids(e0) != ids(e1)
    assert ids(load(uneven, seed=1)) != ids(e0)
    # augmentation seeds differ for every draw of an epoch (k encodes the seed)
    seeds = [v for _, k in e0 for v in k[:, 0, 0, 0].tolist()]
    assert len(set(seeds)) == len(seeds) == 28


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_train_loader__skip_batches_is_the_tail(uneven: Path, workers: int):
    full = load(uneven, num_workers=workers)
    for skip in (1, 4, 7):
        tail = load(uneven, num_workers=workers, skip_batches=skip)
        assert same(tail, full[skip:]), f"skip={skip}"


def test_train_loader__skip_does_not_augment_skipped(uneven: Path):
    calls = []

    def counting(img, seed):
        calls.append(seed)
        return two_crop(img, seed)

    list(train_loader(uneven, transform=counting, batch_size=4, steps=7, epoch=0, seed=0,
                      skip_batches=5))
    assert len(calls) == (7 - 5) * 4


def test_train_loader__bad_arguments(uneven: Path):
    with pytest.raises(ValueError, match="rank must be < world_size"):
        train_loader(uneven, transform=two_crop, batch_size=4, steps=3, epoch=0, seed=0, rank=2,
                     world_size=2)
    with pytest.raises(ValueError, match="skip_batches must be <= steps"):
        train_loader(uneven, transform=two_crop, batch_size=4, steps=3, epoch=0, seed=0,
                     skip_batches=4)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        train_loader(uneven, transform=two_crop, batch_size=0, steps=3, epoch=0, seed=0)
    with pytest.raises(ShardError, match="manifest not found"):
        train_loader(uneven.parent, transform=two_crop, batch_size=4, steps=3, epoch=0, seed=0)


# --- eval ------------------------------------------------------------------------------------


def to_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).view(1, 4, 4)


@pytest.mark.parametrize("workers", [0, 2])
def test_eval_loader__each_sample_once_in_manifest_order(uneven: Path, workers: int):
    loader = eval_loader(uneven, transform=to_tensor, batch_size=5, num_workers=workers)
    batches = list(loader)
    assert len(loader) == 3 and [len(k) for _, _, k in batches] == [5, 5, 2]
    keys = [k for _, _, ks in batches for k in ks]
    assert keys == [f"k{i:03d}" for i in range(12)]  # written in this order
    pixels = torch.cat([x for x, _, _ in batches])[:, 0, 0, 0].long().tolist()
    labels = torch.cat([y for _, y, _ in batches])
    assert pixels == list(range(12)) and labels.dtype == torch.long
    assert labels.tolist() == [i % 3 for i in range(12)]


def test_eval_loader__max_images_prefix(uneven: Path):
    batches = list(eval_loader(uneven, transform=to_tensor, batch_size=4, num_workers=3,
                               max_images=7))
    assert [k for _, _, ks in batches for k in ks] == [f"k{i:03d}" for i in range(7)]
    assert [len(ks) for _, _, ks in batches] == [4, 3]


@pytest.mark.parametrize("loader", ["train", "eval"])
def test_loaders__altered_but_decodable_shard_refused(tmp_path: Path, loader: str):
    d = make_shards(tmp_path / "s", n=6, per_shard=3)
    relabel_first_sample(d / "shard-000001.tar")
    with tarfile.open(d / "shard-000001.tar") as t:  # the alteration alone would go unnoticed
        assert len(t.getmembers()) == 6
    with pytest.raises(ShardError, match=r"shard-000001.tar: sha256 .* != manifest"):
        if loader == "train":
            load(d)
        else:
            list(eval_loader(d, transform=to_tensor, batch_size=2))


def test_eval_loader__pickle_member_refused(tmp_path: Path):
    d = make_shards(tmp_path / "s", n=2, per_shard=5)
    png = io.BytesIO()
    Image.new("L", (4, 4)).save(png, format="PNG")
    with wds.TarWriter(str(d / "shard-000000.tar"), encoder=False) as w:
        w.write({"__key__": "x0", "png": png.getvalue(), "cls": b"0"})
        w.write({"__key__": "x1", "pickle": b"\x80\x04K\x01.", "cls": b"0"})
    rewrite_manifest(d)  # a consistent manifest: the member check itself must refuse the pickle
    with pytest.raises(ShardError, match=r"shard-000000.tar: sample 'x1': member '\.pickle'"):
        list(eval_loader(d, transform=to_tensor, batch_size=2))


def test_eval_loader__short_shard_detected(tmp_path: Path):
    d = make_shards(tmp_path / "s", n=3, per_shard=5)
    m = json.loads((d / "manifest.json").read_text())
    m["shards"][0]["num_samples"] = m["num_samples"] = 4  # manifest claims one more
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ShardError, match="shard-000000.tar: 3 samples, manifest says 4"):
        list(eval_loader(d, transform=to_tensor, batch_size=2))
