"""Shard writing (reproducible, atomic), manifests and verification."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from helpers import says
from PIL import Image

from pipeline.__main__ import verify_main
from pipeline.config import DataParams
from pipeline.data.build import build_all, write_shards
from pipeline.data.shards import ShardError, read_manifest, verify_shards
from pipeline.data.sources import Sample

FASHION_REAL = Path("/usr/share/datasets/fashion-mnist")
REPO = Path(__file__).resolve().parents[2]


def samples(n: int, mode: str = "L", seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    shape = (6, 5) if mode == "L" else (6, 5, 3)
    return [Sample(f"s_{i:04d}", Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)),
                   i % 3) for i in range(n)]


def write(out: Path, items, **kw) -> dict:
    args = dict(split="train", source="toy", class_names=["a", "b", "c"], mode="L",
                samples_per_shard=4, progress=False)
    args.update(kw)
    return write_shards(items, out, **args)


def test_write_shards__byte_identical_rebuild(tmp_path: Path):
    write(tmp_path / "one", samples(10))
    write(tmp_path / "two", samples(10))
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == ["manifest.json", "shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    before = (tmp_path / "one" / "shard-000001.tar").read_bytes()
    write(tmp_path / "one", samples(10))  # rebuilding in place gives the same bytes
    assert (tmp_path / "one" / "shard-000001.tar").read_bytes() == before


def test_write_shards__manifest_counts_and_members(tmp_path: Path):
    items = samples(10)
    m = write(tmp_path / "s", items)
    assert m == read_manifest(tmp_path / "s")
    assert m.num_samples == 10
    assert [s.num_samples for s in m.shards] == [4, 4, 2]
    assert m.label_counts == {"0": 4, "1": 3, "2": 3}
    assert (m.mode, m.image_shape, m.class_names) == ("L", (1, 6, 5), ("a", "b", "c"))
    for s in m.shards:
        data = (tmp_path / "s" / s.name).read_bytes()
        assert (s.bytes, s.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    # read the tar with the standard library, independently of webdataset
    with tarfile.open(tmp_path / "s" / "shard-000002.tar") as tar:
        members = tar.getmembers()
        assert [t.name for t in members] == ["s_0008.cls", "s_0008.png", "s_0009.cls", "s_0009.png"]
        assert {(t.mtime, t.uid, t.gid, t.uname) for t in members} == {(0, 0, 0, "moco")}
        assert tar.extractfile("s_0009.cls").read() == b"0"
        png = Image.open(io.BytesIO(tar.extractfile("s_0009.png").read()))
        assert png.format == "PNG" and png.mode == "L"
        np.testing.assert_array_equal(np.asarray(png), np.asarray(items[9].image))


def test_write_shards__exact_multiple_has_no_empty_shard(tmp_path: Path):
    m = write(tmp_path / "s", samples(8))
    assert [s.num_samples for s in m.shards] == [4, 4]
    assert sorted(p.name for p in (tmp_path / "s").glob("*.tar")) == ["shard-000000.tar",
                                                                     "shard-000001.tar"]


def test_write_shards__pixel_stats_by_hand(tmp_path: Path):
    black = Sample("k0", Image.new("RGB", (2, 2), (0, 0, 0)), 0)
    white = Sample("k1", Image.new("RGB", (2, 2), (255, 255, 51)), 1)
    m = write(tmp_path / "s", [black, white], mode="RGB")
    # channel values {0, 255} -> mean 0.5, std 0.5; {0, 51} -> mean 0.1, std 0.1
    assert m.pixel_mean == (0.5, 0.5, 0.1) and m.pixel_std == (0.5, 0.5, 0.1)
    assert m.mean == m.pixel_mean  # none given: the split's own statistics
    m2 = write(tmp_path / "t", [black, white], mode="RGB", mean=[0.4, 0.4, 0.4], std=[0.2] * 3)
    assert (m2.mean, m2.std) == ((0.4,) * 3, (0.2,) * 3)


def test_write_shards__stats_of_a_large_image_take_no_copy_of_its_pixels(tmp_path: Path):
    # A 1.2 MP RGB image kept as its file's bytes (nothing encoded): its statistics must not
    # copy the pixels (squaring them as uint64 allocated 8 bytes per value, 29 MB here; at
    # 60 MP 1.4 GB). numpy's buffers are traced by tracemalloc, PIL's are not: the peak is what
    # the statistics and the tar writing allocate.
    import tracemalloc

    from pipeline.data.sources.base import SourceFile

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (1000, 1200, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    s = Sample("big", image, 0, SourceFile("JPEG", b"\xff\xd8\xff-the-file-bytes"))
    write(tmp_path / "warm", [Sample("small", Image.new("RGB", (2, 2)), 0)], mode="RGB")
    tracemalloc.start()
    try:
        m = write(tmp_path / "s", [s], mode="RGB")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < pixels.size // 2  # half a byte per value: 1.8 MB (the histogram is 6 KiB)
    values = pixels.reshape(-1, 3).astype(np.float64) / 255  # numpy's mean / std, by hand
    assert m.pixel_mean == pytest.approx(values.mean(axis=0), abs=1e-6)
    assert m.pixel_std == pytest.approx(values.std(axis=0), abs=1e-6)
    assert m.image_shape == (3, 1000, 1200)


@pytest.mark.parametrize("max_side", [8, 0, 2000])
def test_write_shards__one_image_at_a_time(tmp_path: Path, max_side: int):
    # While the source decodes image n, nothing holds image n - 1 any more: neither the
    # writer (the first sample was held for the whole split), nor the resize (shrunk: 8;
    # data.image_size: 0; kept as it is: 2000). A folder of 60 MP photos then peaks at one
    # photo, not two or three. (Smaller images go to the encoder in chunks of about
    # CHUNK_PIXELS; an image of that many pixels goes alone.)
    import weakref

    from pipeline.data.encode import limit_short_side, resize_samples
    from pipeline.data.encode_pool import CHUNK_PIXELS

    alive: list[str] = []

    refs: list[weakref.ref] = []

    def load(i: int) -> Sample:  # as Source._load: nothing of it stays in the source
        image = Image.new("L", (CHUNK_PIXELS // 768 + 1, 768), 40 * i)  # a chunk alone
        refs.append(weakref.ref(image))
        return Sample(f"k{i}", image, 0)

    def source():
        for i in range(5):
            alive.extend(f"{i}: image {j} alive" for j, r in enumerate(refs) if r() is not None)
            yield load(i)

    samples = (limit_short_side(source(), max_side) if max_side
               else resize_samples(source(), 6))
    m = write(tmp_path / "s", samples)
    assert m.num_samples == 5 and alive == []


def test_write_shards__nothing_to_write(tmp_path: Path):
    write(tmp_path / "s", samples(3))
    before = (tmp_path / "s" / "manifest.json").read_bytes()
    with pytest.raises(ShardError, match="no samples"):
        write(tmp_path / "s", [])
    assert (tmp_path / "s" / "manifest.json").read_bytes() == before


def test_write_shards__failure_leaves_previous_outputs(tmp_path: Path):
    write(tmp_path / "s", samples(6))
    before = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()}

    def broken():
        yield from samples(5, seed=1)
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError, match="source died"):
        write(tmp_path / "s", broken())
    assert {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no temp dirs left


@pytest.mark.parametrize("bad, match", [
    (Sample("has.dot", Image.new("L", (2, 2)), 0), "key must match"),
    (Sample("s_0000", Image.new("L", (2, 2)), 0), r"2 \(key 's_0000'\): duplicate key \(sample 0"),
    (Sample("s_0001", Image.new("L", (2, 2)), 0), r"2 \(key 's_0001'\): duplicate key \(sample 1"),
    (Sample("rgb", Image.new("RGB", (2, 2)), 0), "mode RGB, expected L"),
    (Sample("lbl", Image.new("L", (2, 2)), 3), "label 3 outside"),
])
def test_write_shards__bad_sample(tmp_path: Path, bad, match):
    with pytest.raises(ShardError, match=match):
        write(tmp_path / "s", [*samples(2), bad])


def test_write_shards__duplicate_key_in_another_shard_named(tmp_path: Path):
    dup = Sample("s_0002", Image.new("L", (6, 5)), 0)
    with pytest.raises(ShardError, match=r"sample 6 \(key 's_0002'\): duplicate key \(sample 2\)"):
        write(tmp_path / "s", [*samples(6), dup])  # shard 1 repeats a key of shard 0
    assert not (tmp_path / "s").exists()


def test_write_shards__equal_key_digests_of_distinct_keys_are_no_error(tmp_path: Path,
                                                                       monkeypatch):
    class Same:  # every key gets the same digest: the keys themselves are compared
        def __init__(self, *a, **k):
            pass

        def digest(self):
            return bytes(8)

    monkeypatch.setattr("pipeline.data.build.hashlib", type("H", (), {"blake2b": Same}))
    assert write(tmp_path / "s", samples(6)).num_samples == 6
    with pytest.raises(ShardError, match=r"6 \(key 's_0000'\): duplicate key \(sample 0"):
        write(tmp_path / "t", [*samples(6), samples(1)[0]])


def test_write_shards__expected_count(tmp_path: Path):
    with pytest.raises(ShardError, match="wrote 3 samples.*expected 4"):
        write(tmp_path / "s", samples(3), expected_count=4)


# --- verification ----------------------------------------------------------------------------


@pytest.fixture
def built(tmp_path: Path) -> Path:
    write(tmp_path / "s", samples(10))
    return tmp_path / "s"


def test_verify_shards__ok(built: Path, capsys):
    assert verify_shards(built) == {"dir": str(built), "split": "train", "source": "toy",
                                    "num_shards": 3, "num_samples": 10,
                                    "bytes": sum(p.stat().st_size for p in built.glob("*.tar"))}
    assert verify_main(built) == 0
    assert verify_main(built.parent) == 0  # a shards root: every split below it
    assert "10 samples in 3 shard(s)" in capsys.readouterr().out


def test_verify_shards__flipped_byte(built: Path, capsys):
    path = built / "shard-000001.tar"
    data = bytearray(path.read_bytes())
    data[700] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="shard-000001.tar: sha256"):
        verify_shards(built)
    assert verify_main(built) == 1
    assert "shard-000001.tar" in capsys.readouterr().err


def test_verify_shards__truncated(built: Path):
    path = built / "shard-000002.tar"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ShardError, match="shard-000002.tar: 1000 bytes"):
        verify_shards(built)


def test_verify_shards__missing_and_extra(built: Path):
    (built / "shard-000001.tar").rename(built / "shard-000009.tar")
    with pytest.raises(ShardError, match="shard-000001.tar: shard listed in the manifest is"):
        verify_shards(built)
    (built / "shard-000009.tar").rename(built / "shard-000001.tar")
    (built / "shard-000003.tar").write_bytes(b"")
    with pytest.raises(ShardError, match="shard-000003.tar: shard not listed"):
        verify_shards(built)


def rewrite_shard(directory: Path, name: str, records: list[dict]) -> None:
    """Replace a shard and make the manifest agree with it (sha256, bytes, count)."""
    with wds.TarWriter(str(directory / name), encoder=False, mtime=0) as w:
        for r in records:
            w.write(r)
    m = json.loads((directory / "manifest.json").read_text())
    data = (directory / name).read_bytes()
    for s in m["shards"]:
        if s["name"] == name:
            s.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (directory / "manifest.json").write_text(json.dumps(m))


def test_verify_shards__undecodable_image_with_matching_sha(built: Path):
    good = [{"__key__": f"z{i}", "png": b"\x89PNG\r\n\x1a\n broken", "cls": b"1"} for i in range(2)]
    rewrite_shard(built, "shard-000002.tar", good)
    with pytest.raises(ShardError, match="shard-000002.tar: sample 'z0': undecodable image"):
        verify_shards(built)


def test_verify_shards__bytes_no_decoder_knows_are_named_without_a_buffer_address(built: Path):
    records = [{"__key__": f"n{i}", "png": b"not an image at all", "cls": b"1"} for i in range(2)]
    rewrite_shard(built, "shard-000002.tar", records)
    with pytest.raises(ShardError) as e:
        verify_shards(built)
    assert str(e.value).endswith(
        "shard-000002.tar: sample 'n0': undecodable image (UnidentifiedImageError: cannot "
        "identify the image (19 bytes, no PIL decoder recognises them))")


def test_verify_shards__pickle_member_refused(built: Path):
    png = io.BytesIO()
    Image.new("L", (6, 5)).save(png, format="PNG")
    records = [{"__key__": "p0", "png": png.getvalue(), "cls": b"1", "pyd": b"\x80\x04K\x01."},
               {"__key__": "p1", "png": png.getvalue(), "cls": b"1"}]
    rewrite_shard(built, "shard-000002.tar", records)
    with pytest.raises(ShardError, match=r"shard-000002.tar: sample 'p0': member '\.pyd' refused"):
        verify_shards(built)


def test_verify_shards__count_mismatch(built: Path):
    png = io.BytesIO()
    Image.new("L", (6, 5)).save(png, format="PNG")
    rewrite_shard(built, "shard-000002.tar",
                  [{"__key__": "only", "png": png.getvalue(), "cls": b"0"}])
    with pytest.raises(ShardError, match="shard-000002.tar: 1 samples, manifest says 2"):
        verify_shards(built)


def test_read_manifest__missing_and_corrupt(tmp_path: Path):
    with pytest.raises(ShardError, match="manifest.json: manifest not found"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ShardError, match="manifest.json: not a readable JSON"):
        read_manifest(tmp_path)
    write(tmp_path / "s", samples(5))
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    m["num_samples"] = 6
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ShardError, match="manifest.json: invalid manifest: 'num_samples'"):
        read_manifest(tmp_path / "s")


def test_verify_main__nothing_there(tmp_path: Path, capsys):
    assert verify_main(tmp_path) == 1
    assert "no manifest.json" in capsys.readouterr().err


# --- build_all -------------------------------------------------------------------------------


def test_build_all__imagefolder_stats_and_resize(tmp_path: Path):
    raw = tmp_path / "raw"
    for c, value in (("a", 0), ("b", 255)):
        for i in range(4):
            img = Image.new("RGB", (12, 8), (value, value, value))
            (raw / c).mkdir(parents=True, exist_ok=True)
            img.save(raw / c / f"{i}.png")
    params = DataParams(source="imagefolder", root=str(raw), image_size=6, samples_per_shard=3,
                        test_fraction=0.25, max_pretrain_images=4, shards_dir=str(tmp_path / "sh"))
    ms = build_all(params, seed=3, progress=False)
    assert {k: m.num_samples for k, m in ms.items()} == {"pretrain": 4, "train": 6, "test": 2}
    assert ms["pretrain"].label_counts == {"0": 2, "1": 2}  # cap keeps class balance
    assert ms["test"].image_shape == (3, 6, 6)
    # half black, half white pretrain images -> mean 0.5, std 0.5, used by every split
    assert ms["pretrain"].pixel_mean == (0.5, 0.5, 0.5)
    assert ms["test"].mean == (0.5, 0.5, 0.5) and ms["test"].std == (0.5, 0.5, 0.5)
    assert verify_main(tmp_path / "sh") == 0
    first = {p.name: p.read_bytes() for p in (tmp_path / "sh" / "train").iterdir()}
    build_all(params, seed=3, progress=False)
    assert {p.name: p.read_bytes() for p in (tmp_path / "sh" / "train").iterdir()} == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw", "sh"]


def test_build_all__imports_no_torch(tmp_path: Path):
    # importing torch alone takes ~500 MiB resident (benchmarks/big_photo.py: the build of one
    # 60 MP photo peaked at 652 MiB before any pixel); the build needs it nowhere
    import subprocess
    import sys

    raw = tmp_path / "raw"
    for c in ("a", "b"):
        (raw / c).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (40, 30), (60 * i, 90, 30)).save(raw / c / f"{i}.jpg")
    code = (
        "import sys\n"
        "from pipeline.config import DataParams\n"
        "from pipeline.data.build import build_all\n"
        "for kw in ({'image_size': 8}, {'max_side': 16}):\n"
        f"    build_all(DataParams(source='imagefolder', root={str(raw)!r}, test_fraction=0.5,\n"
        f"                         shards_dir={str(tmp_path / 'sh')!r}, **kw), seed=0,\n"
        "              progress=False)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision',\n"
        "                                                            'webdataset')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(not FASHION_REAL.is_dir(), reason="dataset-fashion-mnist not installed")
def test_build_all__fashion_mnist_small(tmp_path: Path):
    params = DataParams(max_pretrain_images=200, max_train_images=100, max_test_images=50,
                        samples_per_shard=64, shards_dir=str(tmp_path / "sh"))
    ms = build_all(params, seed=0, progress=False)
    assert [s.num_samples for s in ms["pretrain"].shards] == [64, 64, 64, 8]
    assert ms["test"].label_counts == {str(c): 5 for c in range(10)}
    assert (ms["train"].mean, ms["train"].std, ms["train"].image_shape) == (
        (0.286,), (0.353,), (1, 28, 28))


def test_build_all__image_cut_short_names_split_file_and_restore(tmp_path: Path):
    # the header is whole, so index_shards let it through; the build decodes the pixels
    raw = tmp_path / "raw"
    for split in ("train", "test"):
        for c in ("a", "b"):
            (raw / split / c).mkdir(parents=True)
            Image.effect_noise((16, 16), 60).convert("L").save(raw / split / c / "0.png")
    params = DataParams(source="imagefolder", root=str(raw), shards_dir=str(tmp_path / "sh"))
    build_all(params, seed=0, progress=False)
    before = {p: p.read_bytes() for p in (tmp_path / "sh").rglob("*") if p.is_file()}
    cut = raw / "test" / "b" / "0.png"
    cut.write_bytes(cut.read_bytes()[:80])  # IHDR intact, IDAT cut
    from pipeline.data.sources import SourceError

    with pytest.raises(SourceError) as e:
        build_all(params, seed=0, progress=False)
    msg = str(e.value)
    assert msg.startswith(f"split test: 1 unreadable image(s): {cut} (") and "\n" not in msg
    assert msg.endswith(f"; fix or remove them and rerun (`dvc checkout {tmp_path / 'sh'}` "
                        "restores the last shards built)")
    # build_all itself keeps the old shards (DVC is what deletes them before the stage)
    assert {p: p.read_bytes() for p in (tmp_path / "sh").rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw", "sh"]
    # a header that breaks (the file's first bytes no PNG): found by the header scan, before
    # any split; the same hint
    cut.write_bytes(b"<html>not an image</html>")
    with pytest.raises(SourceError) as e:
        build_all(params, seed=0, progress=False)
    assert str(e.value) == (f"1 unreadable image(s): {cut} (UnidentifiedImageError); fix or "
                            f"remove them and rerun (`dvc checkout {tmp_path / 'sh'}` restores "
                            "the last shards built)")
    assert {p: p.read_bytes() for p in (tmp_path / "sh").rglob("*") if p.is_file()} == before


def test_build_all__leaves_out_the_broken_files_index_shards_listed(tmp_path: Path,
                                                                    monkeypatch):
    # index_shards let 1 broken file of each folder through (data.max_broken_fraction 0.25):
    # the build reads data/index/folders.json and leaves exactly those out
    from pipeline.atomic import write_json
    from pipeline.data.folder_index import FOLDERS, index_params_folders

    monkeypatch.chdir(tmp_path)
    raw, photos = tmp_path / "raw", tmp_path / "photos"
    for split in ("train", "test"):
        for c in ("a", "b"):
            (raw / split / c).mkdir(parents=True)
            for i in range(2):
                Image.new("L", (8, 8), i).save(raw / split / c / f"{i}.png")
    photos.mkdir()
    for i in range(4):
        Image.new("L", (8, 8), 50 + i).save(photos / f"p{i}.png")
    for cut in (raw / "train" / "b" / "9.png", photos / "zz.png"):
        Image.effect_noise((8, 8), 60).convert("L").save(cut)
        cut.write_bytes(cut.read_bytes()[:60])  # IHDR intact, IDAT cut
    params = DataParams(source="imagefolder", root=str(raw), unlabelled_root=str(photos),
                        max_broken_fraction=0.25, shards_dir=str(tmp_path / "sh"))
    write_json(FOLDERS, index_params_folders(params))
    ms = build_all(params, seed=0, progress=False)
    assert ms["train"].label_counts == {"0": 2, "1": 2}  # train/b/9.png left out
    assert ms["test"].label_counts == {"0": 2, "1": 2}
    assert ms["pretrain"].label_counts == {"-1": 4, "0": 2, "1": 2}  # zz.png left out
    # the manifests do not count them: a broken download added or removed leaves them as
    # they are, so pretraining does not rerun on the same shards
    assert all("broken_left_out" not in m.to_json() for m in ms.values())
    assert ms["pretrain"].build["unlabelled"]["images"] == 4
    # without the index (a build run by hand) nothing is left out: the file stops the build
    FOLDERS.unlink()
    from pipeline.data.sources import SourceError

    with pytest.raises(SourceError, match=r"unreadable image\(s\)"):
        build_all(params, seed=0, progress=False)


def test_build_all__cap_that_drops_the_folder_says_so(tmp_path: Path, caplog):
    # 20 labelled pretrain images (2 classes) + 1 unlabelled, cap 4: shares 4*10/21 = 1.90 per
    # class and 4*1/21 = 0.19 for label -1; floors 1, 1, 0 and the two largest remainders
    # (0.90, 0.90 > 0.19) go to the classes: the folder's image is left out
    raw = tmp_path / "raw"
    for split, n in (("train", 10), ("test", 1)):
        for c in ("a", "b"):
            (raw / split / c).mkdir(parents=True)
            for i in range(n):
                Image.new("L", (8, 8), i).save(raw / split / c / f"{i}.png")
    (tmp_path / "photos").mkdir()
    Image.new("L", (8, 8), 9).save(tmp_path / "photos" / "p.png")
    params = DataParams(source="imagefolder", root=str(raw),
                        unlabelled_root=str(tmp_path / "photos"), max_pretrain_images=4,
                        shards_dir=str(tmp_path / "sh"))
    caplog.set_level("INFO")
    ms = build_all(params, seed=0, progress=False)
    assert ms["pretrain"].label_counts == {"0": 2, "1": 2}
    assert ("pretrain: 0 of the 1 images of data.unlabelled_root are in the split: "
            "data.max_pretrain_images = 4 keeps each label's share, the folder's included (0 "
            "keeps every image; data.pretrain_labelled: false leaves the cap to the folder)"
            ) in [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    caplog.clear()
    build_all(DataParams(**{**vars(params), "max_pretrain_images": 0}), seed=0, progress=False)
    assert "pretrain: all 1 images of data.unlabelled_root are in the split" in caplog.text


# --- sample keys of tar members ----------------------------------------------------------------


@pytest.mark.parametrize(("name", "want"), [
    ("000000001.jpg", ("000000001", "jpg")),  # img2dataset: both rules agree
    ("a.b.c.jpg", ("a.b.c", "jpg")),  # WebDataset's own rule: ("a", "b.c.jpg")
    ("photo.2024.05.JSON", ("photo.2024.05", "JSON")),  # group_by_keys lower-cases the ext
    ("dir.v1/x.png", ("dir.v1/x", "png")),  # a dot in a folder is no separator
    ("dir/.hidden.jpg", (None, None)),  # skipped, as WebDataset skips it
    ("README", (None, None)),
    ("trailing.", (None, None)),
])
def test_member_key__key_ends_at_the_last_dot(name, want):
    from pipeline.data.shards import member_key

    assert member_key(name) == want


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def test_iter_shard__a_key_that_is_another_plus_a_dotted_part_is_refused(tmp_path: Path):
    # k.jpg beside k.seg.png: WebDataset reads one sample k (extensions jpg, seg.png), the
    # last-dot rule two samples k and k.seg; neither reading is safe to guess
    from pipeline.data.shards import iter_shard

    path = _tar(tmp_path / "s.tar", [("k.jpg", b"j"), ("k.seg.png", b"p"), ("m.jpg", b"j")])
    with pytest.raises(ShardError) as e:
        list(iter_shard(path))
    says(str(e.value), f"{path}: sample keys 'k' and 'k.seg'", "rename the members")
    # in the other order too, and apart from each other
    path = _tar(tmp_path / "t.tar", [("k.seg.png", b"p"), ("m.jpg", b"j"), ("k.jpg", b"j")])
    with pytest.raises(ShardError, match="sample keys 'k' and 'k.seg' read two ways"):
        list(iter_shard(path))
    # read from a URL, the same line (not "unreadable shard")
    from helpers import FaultServer

    server = FaultServer(tmp_path)
    try:
        with pytest.raises(ShardError) as e:
            list(iter_shard(f"{server.url}/t.tar"))
    finally:
        server.close()
    assert str(e.value).startswith(f"{server.url}/t.tar: sample keys 'k' and 'k.seg' read two "
                                   "ways: WebDataset ends a key at the first dot")
    # keys with dots that are no other key's prefix are fine: a.b.c and a.b.d
    path = _tar(tmp_path / "u.tar", [("a.b.c.jpg", b"1"), ("a.b.c.json", b"2"),
                                     ("a.b.d.jpg", b"3")])
    assert [(r["__key__"], sorted(k for k in r if not k.startswith("__")))
            for r in iter_shard(path)] == [("a.b.c", ["jpg", "json"]), ("a.b.d", ["jpg"])]
