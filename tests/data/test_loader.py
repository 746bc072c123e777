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

from pipeline.data.build import write_shards
from pipeline.data.eval_loader import eval_loader
from pipeline.data.loader import (
    epoch_order,
    read_manifest,
    reader_runs,
    train_loader,
)
from pipeline.data.shards import ShardError
from pipeline.data.sources import Sample

# 3 workers on this 2-core machine is deliberate (more workers than shards)
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def make_shards(directory: Path, n: int, per_shard: int) -> Path:
    """n 4x4 grey images that encode their index: pixel (0,0) = i // 256, (0,1) = i % 256."""
    items = []
    for i in range(n):
        a = np.zeros((4, 4), dtype=np.uint8)
        a[0, 0], a[0, 1] = divmod(i, 256)
        items.append(Sample(f"k{i:05d}", Image.fromarray(a, "L"), i % 3))
    write_shards(items, directory, split="pretrain", source="toy", class_names=["a", "b", "c"],
                 mode="L", samples_per_shard=per_shard, progress=False)
    return directory


def ids(batches) -> list[list[int]]:
    """The image index of every sample, batch by batch."""
    return [(x[:, 0, 0, 0].long() * 256 + x[:, 0, 0, 1].long()).tolist() for x, _ in batches]


def flat(batches) -> list[int]:
    return [i for b in ids(batches) for i in b]


def load(d: Path, **kw) -> list[tuple[torch.Tensor, list[str]]]:
    args = dict(batch_size=4, steps=3, epoch=0, seed=0)
    args.update(kw)
    return list(train_loader(d, **args))


def epoch_ids(d: Path, *, ranks: int, workers: int, batch: int, epoch: int = 0,
              seed: int = 0) -> list[int]:
    """Every image index one epoch yields over all ranks (the batch-per-rank view)."""
    n = read_manifest(d).num_samples
    steps = n // (batch * ranks)
    out = []
    for r in range(ranks):
        got = load(d, rank=r, world_size=ranks, num_workers=workers, batch_size=batch,
                   steps=steps, epoch=epoch, seed=seed)
        assert len(got) == steps and all(x.shape == (batch, 1, 4, 4) for x, _ in got)
        assert all(x.dtype == torch.uint8 for x, _ in got)
        out += flat(got)
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and x[1] == y[1]
                                    for x, y in zip(a, b))


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("uneven") / "s", n=12, per_shard=5)  # 5, 5, 2


@pytest.fixture(scope="module")
def seventy(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("seventy") / "s", n=70, per_shard=16)


@pytest.mark.parametrize(("ranks", "workers"), [(1, 0), (1, 1), (1, 2), (2, 2)])
def test_train_loader__true_epoch_every_image_once(seventy: Path, ranks: int, workers: int):
    # 70 images in shards of 16, 16, 16, 16, 6; global batch 8 (1 rank) or 16 (2 x 8):
    # 8 or 4 steps per rank use 64 images, the remainder 6 (< one global batch) is dropped.
    e0 = epoch_ids(seventy, ranks=ranks, workers=workers, batch=8)
    assert len(e0) == 64 and len(set(e0)) == 64 and set(e0) <= set(range(70))
    e1 = epoch_ids(seventy, ranks=ranks, workers=workers, batch=8, epoch=1)
    assert len(set(e1)) == 64 and e1 != e0
    assert set(range(70)) - set(e0) != set(range(70)) - set(e1)  # the remainder rotates


def test_train_loader__one_shard_four_readers(tmp_path: Path):
    d = make_shards(tmp_path / "s", n=40, per_shard=100)  # a single shard
    got = epoch_ids(d, ranks=2, workers=2, batch=4)  # 2 ranks x 2 workers, 5 steps each
    assert sorted(got) == list(range(40))  # 40 = 5 x 4 x 2: every image exactly once


def test_reader_runs__rotation_and_wrap_by_hand():
    # shards of 5, 5, 2 in epoch order [2, 0, 1]: positions 0-1 = shard 2, 2-6 = shard 0,
    # 7-11 = shard 1; rotated by 3, the sequence starts at shard 0's sample 1 and wraps.
    assert reader_runs([5, 5, 2], [2, 0, 1], 3, 0, 12) == [(0, 1, 5), (1, 0, 5), (2, 0, 2),
                                                           (0, 0, 1)]
    assert reader_runs([5, 5, 2], [2, 0, 1], 3, 4, 3) == [(1, 0, 3)]
    perm, offset = epoch_order([5, 5, 2], seed=0, epoch=0)
    assert sorted(perm) == [0, 1, 2] and 0 <= offset < 12
    assert epoch_order([5, 5, 2], seed=0, epoch=0) == (perm, offset)


def test_train_loader__mixing_close_to_random_permutations(tmp_path: Path):
    # 6 shards x 1,000 images, batch 50, K = 500 (10 batches of keys), 2 epochs.
    d = make_shards(tmp_path / "s", n=6000, per_shard=1000)
    b, kb, n = 50, 10, 6000
    seqs = [[i for i in flat(load(d, batch_size=b, steps=n // b, epoch=e))] for e in (0, 1)]
    assert all(sorted(s) == list(range(n)) for s in seqs)

    def neighbours(seq: list[int]) -> dict[int, set[int]]:
        out = {}
        for t in range(kb, len(seq) // b):  # windows fully inside the epoch
            prev = set(seq[(t - kb) * b:t * b])
            for i in seq[t * b:(t + 1) * b]:
                out[i] = prev
        return out

    def overlap(a: list[int], c: list[int]) -> float:
        na, nc = neighbours(a), neighbours(c)
        common = [i for i in na if i in nc]
        return float(np.mean([len(na[i] & nc[i]) / len(na[i]) for i in common]))

    rng = np.random.default_rng(0)
    reference = overlap(list(rng.permutation(n)), list(rng.permutation(n)))  # ~K/N = 8.3 %
    assert 0.06 < reference < 0.11
    assert overlap(*seqs) < 1.5 * reference
    # self-negatives: a query whose own image is among the previous K/B batches' keys
    stream = seqs[0] + seqs[1]
    hits = sum(stream[t * b + j] in set(stream[max(0, t - kb) * b:t * b])
               for t in range(len(stream) // b) for j in range(b))
    assert hits / len(stream) < 0.01


def test_train_loader__equal_batches_across_ranks(uneven: Path):
    assert [s.num_samples for s in read_manifest(uneven).shards] == [5, 5, 2]
    per_rank = [load(uneven, rank=r, world_size=2, batch_size=2, num_workers=w)
                for r in (0, 1) for w in (0, 2)]
    assert all(len(batches) == 3 for batches in per_rank)
    assert set(flat(per_rank[0])).isdisjoint(flat(per_rank[2]))  # ranks read different images


def test_train_loader__same_epoch_same_batches(uneven: Path):
    a, b = load(uneven, num_workers=2), load(uneven, num_workers=2)
    assert same(a, b)
    loader = train_loader(uneven, batch_size=4, steps=3, epoch=0, seed=0)
    assert same(list(loader), list(loader))  # re-iterating the same object, in-process
    assert ids(load(uneven, seed=1)) != ids(load(uneven))


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_train_loader__skip_batches_is_the_tail(seventy: Path, workers: int):
    full = load(seventy, num_workers=workers, batch_size=4, steps=17)
    for skip in (1, 4, 17):
        tail = load(seventy, num_workers=workers, batch_size=4, steps=17, skip_batches=skip)
        assert same(tail, full[skip:]), f"skip={skip}"


def test_train_loader__skip_does_not_decode_skipped(uneven: Path, monkeypatch):
    import pipeline.data.readers as readers

    calls = []
    real = readers.decode_record
    monkeypatch.setattr(readers, "decode_record",
                        lambda r, m, **kw: calls.append(1) or real(r, m, **kw))
    list(train_loader(uneven, batch_size=4, steps=3, epoch=0, seed=0, skip_batches=2))
    assert len(calls) == (3 - 2) * 4


def test_train_loader__bad_arguments(uneven: Path):
    with pytest.raises(ValueError, match="rank must be < world_size"):
        train_loader(uneven, batch_size=4, steps=1, epoch=0, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="skip_batches must be <= steps"):
        train_loader(uneven, batch_size=4, steps=3, epoch=0, seed=0, skip_batches=4)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        train_loader(uneven, batch_size=0, steps=3, epoch=0, seed=0)
    with pytest.raises(ValueError, match="needs 16 images, the split has 12"):
        train_loader(uneven, batch_size=4, steps=4, epoch=0, seed=0)
    with pytest.raises(ShardError, match="manifest not found"):
        train_loader(uneven.parent, batch_size=4, steps=3, epoch=0, seed=0)


# --- eval ------------------------------------------------------------------------------------


def to_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).view(1, 4, 4)


@pytest.mark.parametrize("workers", [0, 2])
def test_eval_loader__each_sample_once_in_manifest_order(uneven: Path, workers: int):
    loader = eval_loader(uneven, transform=to_tensor, batch_size=5, num_workers=workers)
    batches = list(loader)
    assert len(loader) == 3 and [len(k) for _, _, k in batches] == [5, 5, 2]
    keys = [k for _, _, ks in batches for k in ks]
    assert keys == [f"k{i:05d}" for i in range(12)]  # written in this order
    pixels = torch.cat([x for x, _, _ in batches])[:, 0, 0, 1].long().tolist()
    labels = torch.cat([y for _, y, _ in batches])
    assert pixels == list(range(12)) and labels.dtype == torch.long
    assert labels.tolist() == [i % 3 for i in range(12)]


def test_eval_loader__max_images_prefix(uneven: Path):
    batches = list(eval_loader(uneven, transform=to_tensor, batch_size=4, num_workers=3,
                               max_images=7))
    assert [k for _, _, ks in batches for k in ks] == [f"k{i:05d}" for i in range(7)]
    assert [len(ks) for _, _, ks in batches] == [4, 3]


@pytest.mark.parametrize("loader", ["train", "eval"])
def test_loaders__altered_but_decodable_shard_refused(tmp_path: Path, loader: str):
    d = make_shards(tmp_path / "s", n=6, per_shard=3)
    relabel_first_sample(d / "shard-000001.tar")
    with tarfile.open(d / "shard-000001.tar") as t:  # the alteration alone would go unnoticed
        assert len(t.getmembers()) == 6
    with pytest.raises(ShardError, match=r"shard-000001.tar: sha256 .* != manifest"):
        if loader == "train":
            load(d, batch_size=2, steps=3)
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


@pytest.mark.parametrize("workers", [0, 2])
def test_eval_loader__shards_read_in_place(tmp_path: Path, workers: int):
    # img2dataset layout (JPEG + .json + .txt, no .cls), the first sample of shard 0 cut short:
    # the index skips it, the loader yields the other 39 once each, in order, label -1
    from helpers import img2dataset_shards

    from pipeline.data.index import index_shards

    img2dataset_shards(tmp_path / "ext", shards=2, per_shard=20, colour=False, broken={0: 1})
    manifest, _ = index_shards(str(tmp_path / "ext"), split="pretrain", key="k",
                               max_broken_fraction=0.1)
    want = [f"00000{i:04d}" for i in range(1, 20)] + [f"00001{i:04d}" for i in range(20)]
    keys, labels = [], []
    first = None
    for x, y, k in eval_loader(tmp_path / "ext", transform=grey16, batch_size=8,
                               num_workers=workers, manifest=manifest):
        first = x[0] if first is None else first
        keys += k
        labels += y.tolist()
    assert keys == want and labels == [-1] * 39
    with tarfile.open(tmp_path / "ext/00000.tar") as tar:  # sample 000000001, decoded by hand
        jpg = tar.extractfile("000000001.jpg").read()
    assert torch.equal(first, grey16(Image.open(io.BytesIO(jpg)).convert("L")))


def grey16(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).view(1, 16, 16)
