"""Encoding on several processes writes the same bytes as one (``data.build_workers``)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import make_samples

from pipeline.config import DataParams
from pipeline.data import encode_pool
from pipeline.data.build import build_all
from pipeline.data.encode_pool import EncodePool, tar_end, tar_member


@pytest.mark.parametrize("sizes", [[0], [1, 511, 512, 513], [1024, 5]])
def test_tar_member__the_bytes_tarfile_writes(sizes):
    # the reference: Python's tarfile writing a `w|` stream, as webdataset's TarWriter does
    names = [f"k{i}_{'x' * (80 if i else 0)}.png" for i in range(len(sizes))]
    ref = io.BytesIO()
    with tarfile.open(fileobj=ref, mode="w|") as tar:
        for name, size in zip(names, sizes):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = size, 0, 0o444
            info.uname = info.gname = "moco"
            tar.addfile(info, io.BytesIO(bytes([7]) * size))
    ours = b"".join(tar_member(n, bytes([7]) * s) for n, s in zip(names, sizes))
    assert ours + tar_end(len(ours)) == ref.getvalue()
    assert len(ref.getvalue()) % 10240 == 0


def test_encode__results_in_order_with_chunks_smaller_than_shards(monkeypatch):
    # 3 processes, chunks of 7 samples: the results come back in the samples' order, and the
    # processes did the work (they started: the first chunk alone is encoded here)
    monkeypatch.setattr(encode_pool, "CHUNK_SAMPLES", 7)
    samples = make_samples(40, size=12)
    seen: list[int] = []
    with EncodePool(3) as pool:
        out = list(pool.encode(iter(samples), "png", lambda n, s: seen.append(n)))
        assert pool._executor is not None
    one = encode_pool.encode_chunk(samples, "png")
    assert seen == list(range(40))
    assert [len(e.members) for e in out] == [7] * 5 + [5]
    assert [m for e in out for m in e.members] == one.members
    by_hand = sum(int(np.asarray(s.image, np.int64).sum()) for s in samples)
    assert sum(e.sums[0] for e in out) == one.sums[0] == by_hand


def _build(root: Path, workers: int) -> dict[str, bytes]:
    params = DataParams(max_pretrain_images=3000, max_train_images=1100, max_test_images=700,
                        samples_per_shard=1000, shards_dir=str(root), build_workers=workers)
    build_all(params, seed=0, progress=False)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_build_all__same_bytes_for_1_and_2_workers(tmp_path: Path, monkeypatch):
    # real Fashion-MNIST, 3 splits, shards of 1,000 cut across chunks of 300 images
    monkeypatch.setattr(encode_pool, "CHUNK_SAMPLES", 300)
    monkeypatch.chdir(tmp_path)
    one, two = _build(tmp_path / "w1", 1), _build(tmp_path / "w2", 2)
    assert sorted(one) == sorted(two)
    assert len([k for k in one if k.endswith(".tar")]) == 3 + 2 + 1
    assert one == two
