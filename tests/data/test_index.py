"""The index of WebDataset shards read in place, the joined pretraining set, and its loader."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import build_tiny_shards, img2dataset_shards, says, upright_reference
from PIL import Image

import pipeline.data.index as index_mod
from pipeline.data.build import empty_split
from pipeline.data.index import check_broken_budget, index_shards, pretrain_manifest
from pipeline.data.loader import train_loader
from pipeline.data.manifest import BrokenSample, ShardEntry, write_manifest
from pipeline.data.shards import ShardError, iter_shard, read_manifest, verify_shards


def write_index(directory, manifest):
    write_manifest(manifest, directory)
    return directory


def no_labels(root):
    """Built splits without images (``data.source: none``, nothing else built)."""
    for split in ("pretrain", "train", "test"):
        empty_split(root / split, split=split, source="none", class_names=(), mode="L",
                    build={})
    return root


def decoded_rgb(paths):
    """Every decodable image of the shards as RGB arrays (a slow, obvious reference)."""
    out = []
    for p in paths:
        with tarfile.open(p) as t:
            for m in t.getmembers():
                if m.name.endswith(".jpg"):
                    try:
                        im = Image.open(io.BytesIO(t.extractfile(m).read()))
                        im.load()
                    except OSError:
                        continue
                    out.append(np.asarray(im.convert("RGB"), dtype=np.float64))
    return out


def test_index__counts_broken_keys_sha_and_pixel_stats(tmp_path):
    paths = img2dataset_shards(tmp_path / "ext", shards=3, per_shard=10, broken={1: 2})
    m, validators = index_shards(f"{tmp_path}/ext/{{00000..00002}}.tar", split="pretrain",
                                 key="data.pretrain_shards", max_broken_fraction=0.1)
    assert [s.num_samples for s in m.shards] == [10, 8, 10]
    assert m.num_samples == 28 and m.num_broken == 2
    assert [b.key for b in m.shards[1].broken] == ["000010000", "000010001"]
    assert [s.sha256 for s in m.shards] == [
        hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    assert [s.bytes for s in m.shards] == [p.stat().st_size for p in paths]
    ref = decoded_rgb(paths)
    assert len(ref) == 28
    pix = np.concatenate([a.reshape(-1, 3) for a in ref]) / 255
    assert m.mode == "RGB" and m.image_shape == (3, 16, 16)
    np.testing.assert_allclose(m.mean, pix.mean(axis=0), atol=1e-6)
    np.testing.assert_allclose(m.std, pix.std(axis=0), atol=1e-6)
    assert set(validators) == {str(p) for p in paths}


def test_index__grey_set_is_one_channel(tmp_path):
    img2dataset_shards(tmp_path / "ext", shards=1, per_shard=4, colour=False)
    m, _ = index_shards(str(tmp_path / "ext"), split="pretrain", key="k",
                        max_broken_fraction=0.0)
    assert m.mode == "L" and len(m.mean) == 1 and m.image_shape == (1, 16, 16)


def test_index__exif_tagged_photos_in_place_are_read_upright(tmp_path):
    # img2dataset shards of 24 x 16 px photos; one is stored as a phone stores a portrait
    # turned on its side: 16 x 24 px and EXIF orientation 8 (turn 90 degrees counter-clockwise
    # to display). Read in place it is decoded upright, like every image: the index records one
    # size, (3, 16, 24), and the loaders get its upright pixels.
    from pipeline.data.readers import decode_any

    (path,) = img2dataset_shards(tmp_path / "ext", shards=1, per_shard=4, size=24)
    with tarfile.open(path) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    key = members[0][0].name.split(".")[0]
    y, x = np.mgrid[0:16, 0:24]  # ramps: red grows to the right, green downwards
    upright = np.stack([x * 10, y * 15, np.full_like(x, 128)], axis=-1).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 8
    buf = io.BytesIO()  # stored turned clockwise, so that turning it back shows `upright`
    Image.fromarray(np.rot90(upright, k=-1).copy()).save(buf, format="JPEG", quality=95,
                                                          exif=exif.tobytes())
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
        for m, data in members:
            if m.name == f"{key}.jpg":
                data = buf.getvalue()
            else:  # the other photos: 24 x 16 too (img2dataset wrote them square)
                data = _landscape(data) if m.name.endswith(".jpg") else data
            m.size = len(data)
            t.addfile(m, io.BytesIO(data))
    m, _ = index_shards(str(tmp_path / "ext"), split="pretrain", key="data.pretrain_shards",
                        max_broken_fraction=0.0)
    assert m.image_shape == (3, 16, 24) and m.num_broken == 0
    record = next(r for r in iter_shard(path) if r["__key__"] == key)
    got = np.asarray(decode_any({**record, "__layout__": "webdataset"}, "RGB"), dtype=int)
    assert got.shape == (16, 24, 3)
    assert np.array_equal(got, upright_reference(buf.getvalue()))  # exif_transpose of PIL's
    assert np.abs(got - upright).mean() < 3  # and the ramps by hand, through q95 JPEG
    assert got[0, 0, 0] < 20 and got[0, -1, 0] > 210 and got[-1, 0, 1] > 200


def _landscape(jpg: bytes) -> bytes:
    """A square JPEG cropped to 24 x 16 px (quality 90)."""
    with Image.open(io.BytesIO(jpg)) as im:
        buf = io.BytesIO()
        im.crop((0, 0, 24, 16)).save(buf, format="JPEG", quality=90)
        return buf.getvalue()


def test_broken_budget__at_the_budget_accepted_above_refused_one_line(tmp_path):
    img2dataset_shards(tmp_path / "ext", shards=2, per_shard=100, broken={1: 1})
    spec = str(tmp_path / "ext")
    m, _ = index_shards(spec, split="pretrain", key="k", max_broken_fraction=0.005)
    assert m.num_broken == 1  # 1 of 200 = 0.5 %: exactly the budget
    with pytest.raises(ShardError) as e:
        index_shards(spec, split="pretrain", key="data.pretrain_shards",
                     max_broken_fraction=0.001)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{tmp_path}/ext/00001.tar: 1 of 100 samples undecodable, first key "
                          "'000010000' (")
    assert ("1 of 200 in data.pretrain_shards = 0.50 % > data.max_broken_fraction 0.001 (0.1 %)"
            in msg)


def test_broken_budget__names_the_worst_shard():
    entries = [ShardEntry(url="a", num_samples=9, bytes=0, sha256="",
                          broken=(BrokenSample("k1", "x"),)),
               ShardEntry(url="b", num_samples=7, bytes=0, sha256="",
                          broken=(BrokenSample("k2", "y"),) * 3)]
    with pytest.raises(ShardError, match=r"^b: 3 of 10 samples undecodable, first key 'k2'"):
        check_broken_budget(entries, 0.1, "k")
    check_broken_budget(entries, 0.2, "k")  # 4 of 20


def test_index__a_sample_without_image_is_broken(tmp_path):
    path = tmp_path / "ext" / "00000.tar"
    path.parent.mkdir()
    with tarfile.open(path, "w") as t:
        for name, data in (("a.json", b"{}"), ("a.txt", b"caption")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    with pytest.raises(ShardError, match=r"first key 'a' \(no image member \(has json, txt\)\)"):
        index_shards(str(path.parent), split="pretrain", key="k", max_broken_fraction=0.5)


def test_index__unchanged_shards_not_read_again_changed_ones_are(tmp_path, monkeypatch):
    paths = img2dataset_shards(tmp_path / "ext", shards=3, per_shard=5)
    spec = str(tmp_path / "ext")
    first, v1 = index_shards(spec, split="pretrain", key="k", max_broken_fraction=0)
    reads = []
    real = index_mod._read_shard
    monkeypatch.setattr(index_mod, "_read_shard",
                        lambda url, *a: reads.append(url) or real(url, *a))
    again, v2 = index_shards(spec, split="pretrain", key="k", max_broken_fraction=0,
                             previous=first, validators=v1)
    assert reads == [] and again == first and v2 == v1
    img2dataset_shards(tmp_path / "ext", shards=1, per_shard=7, start=1, seed=5)  # rewrite one
    changed, v3 = index_shards(spec, split="pretrain", key="k", max_broken_fraction=0,
                               previous=first, validators=v1)
    assert reads == [str(paths[1])]
    assert changed.num_samples == 17 and changed.shards[0] == first.shards[0]
    # the same shards spelled as a glob: the same URLs, unchanged, so none is read again, and
    # the manifest (a dep of build_shards and pretrain) has the same bytes: nothing reruns
    globbed, v4 = index_shards(f"{spec}/*.tar", split="pretrain", key="k", max_broken_fraction=0,
                               previous=changed, validators=v3)
    assert len(reads) == 1 and v4 == v3
    assert globbed.to_json() == changed.to_json()


def test_index__a_shard_added_to_the_directory_is_read_the_others_kept(tmp_path, monkeypatch):
    img2dataset_shards(tmp_path / "ext", shards=2, per_shard=5)
    first, v1 = index_shards(str(tmp_path / "ext"), split="pretrain", key="k",
                             max_broken_fraction=0)
    reads = []
    real = index_mod._read_shard
    monkeypatch.setattr(index_mod, "_read_shard",
                        lambda url, *a: reads.append(url) or real(url, *a))
    (added,) = img2dataset_shards(tmp_path / "ext", shards=1, per_shard=3, start=2)
    now, _ = index_shards(str(tmp_path / "ext"), split="pretrain", key="k",
                          max_broken_fraction=0, previous=first, validators=v1)
    assert reads == [str(added)] and now.num_samples == 13
    assert now.shards[:2] == first.shards


def test_index_sets__changed_only_when_a_manifest_on_disk_differs(tmp_path, monkeypatch):
    from pipeline.atomic import write_json
    from pipeline.data.index import VALIDATORS, index_location, index_sets

    monkeypatch.chdir(tmp_path)
    img2dataset_shards(tmp_path / "ext", shards=2, per_shard=5)
    sets = {"pretrain": ("ext", "data.pretrain_shards"), "labelled": ("", "data.root")}
    manifests, fresh, changed = index_sets(sets, max_broken_fraction=0)
    assert changed  # nothing on disk yet
    assert manifests["pretrain"].num_samples == 10 and manifests["labelled"].shards == ()
    assert len(fresh) == 2  # one change detector per shard
    for split, m in manifests.items():  # what the stage writes
        write_manifest(m, index_location(split))
    write_json(VALIDATORS, fresh)
    reads = []
    real = index_mod._read_shard
    monkeypatch.setattr(index_mod, "_read_shard",
                        lambda url, *a: reads.append(url) or real(url, *a))
    again, fresh2, changed2 = index_sets(sets, max_broken_fraction=0)
    assert not changed2 and reads == [] and again == manifests and fresh2 == fresh
    img2dataset_shards(tmp_path / "ext", shards=1, per_shard=7, start=1, seed=5)  # rewrite one
    now, _, changed3 = index_sets(sets, max_broken_fraction=0)
    assert changed3 and len(reads) == 1 and now["pretrain"].num_samples == 12


def test_pretrain_manifest__no_index_is_the_built_split(tmp_path):
    shards = build_tiny_shards(tmp_path / "sh", n_pretrain=32, n_train=16, n_test=16)
    assert pretrain_manifest(shards, None) == read_manifest(shards / "pretrain")
    with pytest.raises(ShardError, match="no index of data.pretrain_shards"):
        pretrain_manifest(shards, tmp_path / "missing")


def test_pretrain_manifest__joined_takes_the_evaluation_mode_and_size(tmp_path):
    shards = build_tiny_shards(tmp_path / "sh", n_pretrain=32, n_train=16, n_test=16, size=16)
    img2dataset_shards(tmp_path / "ext", shards=2, per_shard=10)
    m, _ = index_shards(str(tmp_path / "ext"), split="pretrain", key="k", max_broken_fraction=0)
    joined = pretrain_manifest(shards, write_index(tmp_path / "idx", m))
    train = read_manifest(shards / "train")
    assert joined.num_samples == 32 + 20 and len(joined.shards) == 1 + 2
    assert (joined.mode, joined.mean, joined.std) == ("L", train.mean, train.std)
    assert joined.image_shape == (1, 16, 16) and joined.build["variable"] is False
    assert joined.shards[0].url == str(shards / "pretrain" / "shard-000000.tar")
    # external images of another size: cropped per image to the evaluation size
    img2dataset_shards(tmp_path / "ext24", shards=1, per_shard=10, size=24)
    m24, _ = index_shards(str(tmp_path / "ext24"), split="pretrain", key="k",
                          max_broken_fraction=0)
    j24 = pretrain_manifest(shards, write_index(tmp_path / "idx24", m24))
    assert j24.image_shape is None and j24.build == {
        "image_size": 16, "variable": True, "parts": [str(shards / "pretrain"),
                                                      str(tmp_path / "idx24")]}


def test_pretrain_manifest__no_labelled_data_needs_a_crop_size(tmp_path):
    no_labels(tmp_path / "sh")
    img2dataset_shards(tmp_path / "a", shards=1, per_shard=4, size=16)
    img2dataset_shards(tmp_path / "a", shards=1, per_shard=4, size=20, start=1)
    m, _ = index_shards(str(tmp_path / "a"), split="pretrain", key="k", max_broken_fraction=0)
    idx = write_index(tmp_path / "idx", m)
    with pytest.raises(ShardError, match="no single square size .* set data.image_size"):
        pretrain_manifest(tmp_path / "sh", idx)
    j = pretrain_manifest(tmp_path / "sh", idx, image_size=12)
    assert (j.mode, j.mean, j.build["image_size"]) == ("RGB", m.mean, 12)


def _epoch_keys(manifest, *, world_size=1, num_workers=0, epoch=0, batch=4):
    steps = manifest.num_samples // (batch * world_size)
    keys = []
    for rank in range(world_size):
        for _, k in train_loader("joined", batch_size=batch, steps=steps, epoch=epoch, seed=3,
                                 rank=rank, world_size=world_size, num_workers=num_workers,
                                 manifest=manifest):
            keys += k
    return keys


@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 0), (1, 2), (2, 1)])
def test_train_loader__joined_set_true_epoch_broken_never_seen(tmp_path, world_size,
                                                               num_workers):
    shards = build_tiny_shards(tmp_path / "sh", n_pretrain=24, n_train=8, n_test=8)
    img2dataset_shards(tmp_path / "ext", shards=2, per_shard=9, broken={0: 1})
    m, _ = index_shards(str(tmp_path / "ext"), split="pretrain", key="k",
                        max_broken_fraction=0.1)
    joined = pretrain_manifest(shards, write_index(tmp_path / "idx", m))
    assert joined.num_samples == 24 + 17
    everything = {f"s{i:05d}" for i in range(24)} | {
        f"{s:05d}{i:04d}" for s in (0, 1) for i in range(9)} - {"000000000"}
    keys = _epoch_keys(joined, world_size=world_size, num_workers=num_workers)
    per = 4 * world_size
    assert len(keys) == len(set(keys)) == 41 // per * per  # no image twice in an epoch
    assert set(keys) <= everything and "000000000" not in keys
    assert _epoch_keys(joined, world_size=world_size, num_workers=num_workers) == keys


def test_train_loader__foreign_members_ignored_never_unpickled(tmp_path):
    class Boom:
        def __reduce__(self):
            return (open, (str(tmp_path / "UNPICKLED"), "w"))

    path = tmp_path / "ext" / "00000.tar"
    path.parent.mkdir()
    with tarfile.open(path, "w") as t:
        for i in range(4):
            buf = io.BytesIO()
            Image.new("RGB", (16, 16), (i * 60, 0, 0)).save(buf, format="PNG")
            for ext, data in (("png", buf.getvalue()), ("pyd", pickle.dumps(Boom())),
                              ("txt", b"caption")):
                info = tarfile.TarInfo(f"k{i}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    m, _ = index_shards(str(path.parent), split="pretrain", key="k", max_broken_fraction=0)
    no_labels(tmp_path / "sh")
    joined = pretrain_manifest(tmp_path / "sh", write_index(tmp_path / "idx", m))
    (images, keys), = list(train_loader("joined", batch_size=4, steps=1, epoch=0, seed=0,
                                        manifest=joined))
    assert sorted(keys) == ["k0", "k1", "k2", "k3"] and images.shape == (4, 3, 16, 16)
    assert sorted(images[:, 0, 0, 0].tolist()) == [0, 60, 120, 180]
    assert not (tmp_path / "UNPICKLED").exists()


def test_verify_shards__index_manifest_and_an_altered_shard(tmp_path):
    paths = img2dataset_shards(tmp_path / "ext", shards=2, per_shard=5, broken={0: 1})
    m, _ = index_shards(str(tmp_path / "ext"), split="pretrain", key="k",
                        max_broken_fraction=0.5)
    idx = write_index(tmp_path / "idx", m)
    assert verify_shards(idx)["num_samples"] == 9
    data = bytearray(paths[1].read_bytes())
    data[600] ^= 1
    paths[1].write_bytes(bytes(data))
    with pytest.raises(ShardError, match="00001.tar: size or sha256 differs"):
        verify_shards(idx)


def _listing_by_hand(root, names):
    """sha256 of '<relative path>\\t<bytes>\\t<mtime ns>\\n' over ``names`` in the given order."""
    h = hashlib.sha256()
    for n in names:
        st = (root / n).stat()
        h.update(f"{n}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def test_index_folders__listing_digest_counts_and_skips(tmp_path):
    from pipeline.data.folder_index import index_folders

    root = tmp_path / "photos"
    (root / "a" / "b").mkdir(parents=True)
    Image.new("L", (5, 7)).save(root / "a" / "b" / "x.png")
    Image.new("RGB", (9, 4)).save(root / "y.jpg")
    (root / "README.txt").write_text("notes\n")
    (root / "._y.jpg").write_bytes(b"\0\5\26\7")
    (root / ".DS_Store").write_bytes(b"\0")
    got = index_folders({"data.unlabelled_root": str(root), "data.root": ""})
    names = ["a/b/x.png", "y.jpg"]  # sorted relative paths; junk skipped
    assert got == {"data.unlabelled_root": {
        "root": str(root), "images": 2,
        "bytes": sum((root / n).stat().st_size for n in names),
        "skipped": {"appledouble": 1, "hidden": 1, "not_image": 1},
        "listing_sha256": _listing_by_hand(root, names),
        "mode": "RGB"}}  # y.jpg is colour: the folder rule makes the whole folder RGB
    # junk (skipped: 1 hidden, 1 AppleDouble, 1 not an image) changes nothing; an added image,
    # a rewritten one or a touched one change the digest
    (root / "notes.json").write_text("{}")
    junk = index_folders({"k": str(root)})["k"]
    assert junk["listing_sha256"] == _listing_by_hand(root, names)
    assert junk["skipped"] == {"appledouble": 1, "hidden": 1, "not_image": 2}
    Image.new("L", (3, 3)).save(root / "a" / "z.png")
    added = index_folders({"k": str(root)})["k"]
    assert added["images"] == 3
    assert added["listing_sha256"] == _listing_by_hand(root, ["a/b/x.png", "a/z.png", "y.jpg"])
    st = (root / "y.jpg").stat()
    os.utime(root / "y.jpg", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert index_folders({"k": str(root)})["k"]["listing_sha256"] != added["listing_sha256"]


def test_index_folders__missing_or_empty_named_in_one_line(tmp_path):
    from pipeline.data.folder_index import index_folders
    from pipeline.data.sources import SourceError

    with pytest.raises(SourceError) as e:
        index_folders({"data.unlabelled_root": str(tmp_path / "nope")})
    assert str(e.value) == f"data.unlabelled_root = '{tmp_path / 'nope'}': not a directory"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.txt").write_text("x")
    with pytest.raises(SourceError) as e:
        index_folders({"data.unlabelled_root": str(empty)})
    says(str(e.value), f"data.unlabelled_root = '{empty}'", "no images", ".jpg, .jpeg, .png",
         "{'not_image': 1}")


def test_index_folders__dangling_symlink_is_a_broken_file_like_an_empty_one(tmp_path, caplog):
    # gone.png points nowhere, empty.png holds no byte: both are broken files, counted against
    # data.max_broken_fraction, listed by name and left out by the build; over the budget both
    # are named in the one error line
    from pipeline.data.folder_index import index_folders
    from pipeline.data.sources import SourceError

    root = tmp_path / "photos"
    root.mkdir()
    for i in range(4):
        Image.new("L", (4, 4), 40 * i).save(root / f"ok{i}.png")
    (root / "gone.png").symlink_to(tmp_path / "deleted.png")
    (root / "empty.png").write_bytes(b"")
    with pytest.raises(SourceError) as e:
        index_folders({"data.unlabelled_root": str(root)}, max_broken_fraction=0.2)
    says(str(e.value), f"data.unlabelled_root = '{root}'", "2 unreadable image(s)",
         f"{root / 'empty.png'} (UnidentifiedImageError)",
         f"{root / 'gone.png'} (a symlink to nothing: {tmp_path / 'deleted.png'})",
         "2 of 6 images broken = 33.33 % > data.max_broken_fraction 0.2")
    caplog.set_level(logging.WARNING)
    got = index_folders({"data.unlabelled_root": str(root)}, max_broken_fraction=0.4)
    entry = got["data.unlabelled_root"]
    assert entry["broken"] == ["empty.png", "gone.png"] and entry["images"] == 6
    assert entry["bytes"] == sum((root / f"ok{i}.png").stat().st_size for i in range(4))
    assert (f"data.unlabelled_root: skipping a broken image: {root / 'gone.png'} (a symlink to "
            f"nothing: {tmp_path / 'deleted.png'})") in caplog.messages
    # the listing names the link as unreadable: the target appearing changes the digest and
    # the file is read (and found good) again
    h = hashlib.sha256()
    for name in ("empty.png", "gone.png", "ok0.png", "ok1.png", "ok2.png", "ok3.png"):
        if name == "gone.png":
            h.update(b"gone.png\tunreadable\n")
        else:
            st = (root / name).stat()
            h.update(f"{name}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    assert entry["listing_sha256"] == h.hexdigest()
    Image.new("L", (4, 4)).save(tmp_path / "deleted.png")
    again = index_folders({"data.unlabelled_root": str(root)}, got, max_broken_fraction=0.4)
    assert again["data.unlabelled_root"]["broken"] == ["empty.png"]
    assert again["data.unlabelled_root"]["listing_sha256"] != entry["listing_sha256"]


def test_index_folders__unreadable_or_unsupported_image_named_in_one_line(tmp_path):
    # the images are read here, in index_shards, before build_shards deletes the shards
    from pipeline.data.folder_index import index_folders
    from pipeline.data.sources import SourceError

    root = tmp_path / "photos"
    (root / "a").mkdir(parents=True)
    Image.new("L", (4, 4)).save(root / "a" / "ok.png")
    (root / "a" / "page.jpg").write_bytes(b"<html>404 not found</html>")
    (root / "empty.png").write_bytes(b"")
    with pytest.raises(SourceError) as e:
        index_folders({"data.unlabelled_root": str(root)})
    says(str(e.value), f"data.unlabelled_root = '{root}'", "2 unreadable image(s)",
         f"{root / 'a' / 'page.jpg'} (UnidentifiedImageError)",
         f"{root / 'empty.png'} (UnidentifiedImageError)",
         "2 of 3 images broken = 66.67 % > data.max_broken_fraction 0")
    (root / "a" / "page.jpg").unlink()
    Image.new("LAB", (4, 4)).save(root / "a" / "print.tif")
    with pytest.raises(SourceError) as e:  # both kinds in the same line
        index_folders({"data.root": str(root)})
    msg = str(e.value)
    assert msg.startswith(f"data.root = '{root}': 1 unreadable image(s): "
                          f"{root / 'empty.png'} (UnidentifiedImageError); 1 image(s) in an "
                          f"unsupported mode: {root / 'a' / 'print.tif'} (") and "\n" not in msg
    (root / "empty.png").unlink()
    (root / "a" / "print.tif").unlink()
    assert index_folders({"data.root": str(root)})["data.root"]["images"] == 1


def test_index_folders__file_cut_short_past_its_header_named_before_the_build(tmp_path):
    # an interrupted download keeps a good header: the header scan alone passes it, and the
    # build found it only after DVC had deleted the shards. index_folders decodes the pixels
    # (a JPEG at 1/8 scale) and names it with PIL's message.
    from pipeline.data.folder_index import index_folders
    from pipeline.data.sources import SourceError
    from pipeline.data.sources.files import scan_headers

    root = tmp_path / "photos"
    root.mkdir()
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8))
    photo.save(root / "a_ok.jpg", quality=90)
    photo.save(root / "b_ok.png")
    for name in ("a_ok.jpg", "b_ok.png"):
        data = (root / name).read_bytes()
        (root / name.replace("ok", "cut")).write_bytes(data[: len(data) // 2])
    paths = sorted(str(q) for q in root.iterdir())
    assert scan_headers(paths) == ({"RGB"}, {(128, 96)})  # headers alone: all four pass
    with pytest.raises(SourceError) as e:
        index_folders({"data.unlabelled_root": str(root)})
    msg = str(e.value)  # libjpeg's count of bytes left depends on its buffer: not pinned
    assert msg.startswith(f"data.unlabelled_root = '{root}': 2 unreadable image(s): "
                          f"{root / 'a_cut.jpg'} (OSError: image file is truncated (")
    assert msg.endswith(f" bytes not processed)); {root / 'b_cut.png'} (OSError: image file is "
                        "truncated); 2 of 4 images broken = 50.00 % > data.max_broken_fraction "
                        "0 (fix or remove them, or raise it)")
    for name in ("a_cut.jpg", "b_cut.png"):
        (root / name).unlink()
    assert index_folders({"k": str(root)})["k"]["images"] == 2


def test_index_folders__broken_within_the_budget_are_listed_and_left_out(tmp_path, caplog,
                                                                       monkeypatch):
    # data.max_broken_fraction: 1 broken of 5 images is 0.20 <= 0.25, listed (relative to the
    # folder) and logged; at 0.1 the same folder stops, naming the file and the budget
    import pipeline.data.folder_index as index_mod
    from pipeline.data.folder_index import broken_in_folder, index_folders
    from pipeline.data.sources import SourceError

    root = tmp_path / "photos"
    (root / "d").mkdir(parents=True)
    for i in range(4):
        Image.new("L", (6, 6), i).save(root / f"{i}.png")
    Image.effect_noise((16, 16), 60).convert("L").save(root / "d" / "cut.png")
    cut = root / "d" / "cut.png"
    cut.write_bytes(cut.read_bytes()[:80])  # IHDR intact, IDAT cut
    caplog.set_level("INFO")
    got = index_folders({"data.unlabelled_root": str(root)}, max_broken_fraction=0.25)
    entry = got["data.unlabelled_root"]
    assert entry["images"] == 5 and entry["broken"] == ["d/cut.png"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned[0].startswith(f"data.unlabelled_root: skipping a broken image: "
                                f"{root / 'd' / 'cut.png'} (")
    assert warned[1] == ("data.unlabelled_root: 1 of 5 images skipped as broken "
                         "(data.max_broken_fraction 0.25)")
    assert broken_in_folder("data.unlabelled_root", str(root), got, 0.25) == {"d/cut.png"}
    assert broken_in_folder("data.unlabelled_root", str(tmp_path), got, 0.25) == frozenset()
    assert broken_in_folder("data.root", str(root), got, 0.25) == frozenset()
    assert broken_in_folder("data.root", str(root), None, 0.25) == frozenset()
    # the build run by hand under a lower budget than the index was written with
    with pytest.raises(SourceError) as e:
        broken_in_folder("data.unlabelled_root", str(root), got, 0.1)
    assert str(e.value) == (f"data/index/folders.json lists 1 broken images of 5 in "
                            f"data.unlabelled_root = '{root}', more than data.max_broken_fraction "
                            "0.1: run index_shards first (`dvc repro`)")
    # the listing unchanged: the list is carried over without decoding anything again
    monkeypatch.setattr(index_mod, "read_images", None)
    assert index_folders({"data.unlabelled_root": str(root)}, got,
                         max_broken_fraction=0.25) == got
    monkeypatch.undo()
    # a lower budget reads the folder again, and stops
    with pytest.raises(SourceError) as e:
        index_folders({"data.unlabelled_root": str(root)}, got, max_broken_fraction=0.1)
    msg = str(e.value)
    assert msg.startswith(f"data.unlabelled_root = '{root}': 1 unreadable image(s): "
                          f"{root / 'd' / 'cut.png'} (")
    assert msg.endswith("; 1 of 5 images broken = 20.00 % > data.max_broken_fraction 0.1 (fix "
                        "or remove them, or raise it)")
    # an unsupported mode stops within the budget too, naming only that file
    Image.new("LAB", (4, 4)).save(root / "print.tif")
    with pytest.raises(SourceError) as e:
        index_folders({"data.unlabelled_root": str(root)}, max_broken_fraction=0.25)
    assert str(e.value).startswith(f"data.unlabelled_root = '{root}': 1 image(s) in an "
                                   f"unsupported mode: {root / 'print.tif'} (")


def test_index_folders__finds_what_the_build_refuses_past_the_header(tmp_path):
    # a float TIFF with values outside 0..1 and a PNG whose eXIf chunk after the pixels does
    # not parse: headers pass, the build's reader (open_upright) refuses both; the decode
    # check finds them first, within the budget left out (2 of 4 at 0.5)
    import struct
    import zlib

    from pipeline.data.folder_index import index_folders
    from pipeline.data.sources.base import UnreadableImage
    from pipeline.data.sources.files import open_upright, read_images

    root = tmp_path / "photos"
    root.mkdir()
    Image.new("L", (6, 6), 1).save(root / "a.png")
    Image.fromarray(np.full((6, 6), 0.5, np.float32), mode="F").save(root / "b_ok.tif")
    Image.fromarray(np.full((6, 6), 5.0, np.float32), mode="F").save(root / "c_float.tif")
    png = (root / "a.png").read_bytes()
    body = b"garbage!garbage!"
    chunk = (struct.pack(">I", len(body)) + b"eXIf" + body
             + struct.pack(">I", zlib.crc32(b"eXIf" + body)))
    iend = png.rindex(b"IEND") - 4
    (root / "d_exif.png").write_bytes(png[:iend] + chunk + png[iend:])
    paths = sorted(str(p) for p in root.iterdir())
    assert read_images(paths).bad == {}  # headers alone pass all four
    for name in ("c_float.tif", "d_exif.png"):
        with pytest.raises(UnreadableImage):
            open_upright(str(root / name), "L")
    got = index_folders({"k": str(root)}, max_broken_fraction=0.5)["k"]
    assert got["broken"] == ["c_float.tif", "d_exif.png"]
    bad = read_images(paths, decode=True).bad
    assert bad[str(root / "c_float.tif")] == (
        f"{root / 'c_float.tif'} (mode F (float) values span 5..5, outside the accepted 0..1; "
        "convert it to 8 or 16 bit)")
    assert bad[str(root / "d_exif.png")].startswith(f"{root / 'd_exif.png'} (SyntaxError: ")


def test_over_budget__a_share_written_in_params_is_met_exactly():
    from pipeline.data.index import over_budget

    assert not over_budget(29, 100, 0.29)  # 0.29 * 100 = 28.999999999999996 in floats
    assert over_budget(30, 100, 0.29)
    assert not over_budget(1, 1000, 0.001) and over_budget(2, 1000, 0.001)
    assert over_budget(1, 999, 0.001) and not over_budget(0, 0, 0.0)


def test_index_folders__a_fifo_named_like_an_image_stops_instead_of_hanging(tmp_path):
    from pipeline.data.folder_index import index_folders
    from pipeline.data.sources import SourceError

    root = tmp_path / "photos"
    root.mkdir()
    Image.new("L", (4, 4)).save(root / "ok.png")
    os.mkfifo(root / "pipe.jpg")
    with pytest.raises(SourceError) as e:
        index_folders({"data.unlabelled_root": str(root)}, max_broken_fraction=0.9)
    assert str(e.value) == (f"data.unlabelled_root: {root / 'pipe.jpg'}: not a regular file (a "
                            "FIFO, socket or device)")


def test_index_folders__relative_folder_missing_here_is_read_from_dvc_root(tmp_path,
                                                                          monkeypatch):
    # a queued / temp `dvc exp run` copy lacks the untracked folder: the main repo's is listed,
    # and the entry (the path as written, the digest of relative paths) is the same as there
    from pipeline.data.folder_index import index_folders
    from pipeline.data.sources.base import local_path

    main, copy = tmp_path / "main", tmp_path / "copy"
    (main / "data/raw/photos/a").mkdir(parents=True)
    copy.mkdir()
    Image.new("L", (6, 6)).save(main / "data/raw/photos/a/x.png")
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.chdir(main)
    there = index_folders({"k": "data/raw/photos"})
    monkeypatch.chdir(copy)
    assert local_path("data/raw/photos") == Path("data/raw/photos")  # no DVC_ROOT: as written
    monkeypatch.setenv("DVC_ROOT", str(main))
    assert local_path("data/raw/photos") == main / "data/raw/photos"
    assert local_path("/abs/path") == Path("/abs/path")
    assert index_folders({"k": "data/raw/photos"}) == there
    assert there["k"]["root"] == "data/raw/photos"


def test_index_folders__many_broken_files_give_a_short_line_and_a_full_log(tmp_path, caplog):
    # 300 broken downloads made one 15,573-character line; now 10 are named, all are logged
    from pipeline.data.folder_index import index_folders
    from pipeline.data.sources import SourceError

    root = tmp_path / "photos"
    root.mkdir()
    Image.new("L", (4, 4)).save(root / "ok.png")
    for i in range(12):
        (root / f"p{i:02d}.jpg").write_bytes(b"<html>404</html>")
    with open(os.fsencode(root) + b"/zz-caf\xe9.png", "wb"):  # a Latin-1 name, empty file
        pass
    with pytest.raises(SourceError) as e:
        index_folders({"data.unlabelled_root": str(root)})
    named = "; ".join(f"{root}/p{i:02d}.jpg (UnidentifiedImageError)" for i in range(10))
    assert str(e.value) == (f"data.unlabelled_root = '{root}': 13 unreadable image(s): "
                            f"{named}; ... and 3 more (all 13 logged above); 13 of 14 "
                            "images broken = 92.86 % > data.max_broken_fraction 0 (fix or "
                            "remove them, or raise it)")
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert logged[-3:] == [f"unreadable image: {root}/p{i:02d}.jpg (UnidentifiedImageError)"
                           for i in (10, 11)] + [
        "unreadable image: " + repr(os.fsencode(root) + b"/zz-caf\xe9.png")
        + " (UnidentifiedImageError)"]
    assert len(logged) == 13


def test_index_folders__unchanged_listing_skips_the_header_check(tmp_path, caplog):
    # the last index passed the check for exactly this listing (path, bytes, mtime of each
    # image), so the headers are not read again; any change to the listing reads them all
    from pipeline.data.folder_index import index_folders, read_previous_folders
    from pipeline.data.sources import SourceError

    root = tmp_path / "photos"
    root.mkdir()
    for i in range(3):
        Image.new("L", (4, 4), i).save(root / f"{i}.png")
    first = index_folders({"data.unlabelled_root": str(root)})
    (tmp_path / "folders.json").write_text(json.dumps(first))
    previous = read_previous_folders(tmp_path / "folders.json")
    assert previous == first
    # a broken file with the old bytes count and mtime: the listing cannot tell, so it passes
    st = os.stat(root / "1.png")
    (root / "1.png").write_bytes(b"x" * st.st_size)
    os.utime(root / "1.png", ns=(st.st_atime_ns, st.st_mtime_ns))
    caplog.set_level("INFO")
    assert index_folders({"data.unlabelled_root": str(root)}, previous) == first
    assert "listing unchanged since the last index, images not read again" in caplog.text
    # the same folder under another key, or another root, or no previous index: read
    for folders, prev in (({"data.root": str(root)}, previous),
                          ({"data.unlabelled_root": str(root)}, None),
                          ({"data.unlabelled_root": str(root)}, {"data.unlabelled_root": "x"})):
        with pytest.raises(SourceError, match=r"1 unreadable image\(s\): .*1\.png"):
            index_folders(folders, prev)
    os.utime(root / "1.png")  # touched: a new listing, so every header is read
    with pytest.raises(SourceError, match=r"1 unreadable image\(s\): .*1\.png"):
        index_folders({"data.unlabelled_root": str(root)}, previous)
    (tmp_path / "folders.json").write_text("{not json")
    assert read_previous_folders(tmp_path / "folders.json") is None
    assert read_previous_folders(tmp_path / "missing.json") is None


def test_index_params_folders__class_layout_checked_before_the_build(tmp_path, monkeypatch):
    # index_shards runs before build_shards deletes the shards: a class folder without images,
    # or whose every image is broken (and so left out within the budget), stops it there
    from pipeline.config import DataParams
    from pipeline.data.folder_index import index_params_folders
    from pipeline.data.sources import SourceError

    monkeypatch.chdir(tmp_path)
    root = tmp_path / "raw"
    for cls in ("coat", "shoe"):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("L", (6, 6), 40 * i).save(root / cls / f"{i}.png")
    params = DataParams(source="imagefolder", root=str(root), test_fraction=0.5,
                        max_broken_fraction=0.5)
    assert index_params_folders(params)["data.root"]["images"] == 6
    (root / "empty").mkdir()
    with pytest.raises(SourceError) as e:
        index_params_folders(params)
    assert str(e.value) == ("class folder(s) without images (.jpg, .jpeg, .png, .webp, .bmp, "
                            f".tif, .tiff): {root / 'empty'}")
    (root / "empty").rmdir()
    for i in range(3):  # every shoe cut short past its header: 3 of 6 broken, within 0.5
        cut = root / "shoe" / f"{i}.png"
        Image.effect_noise((16, 16), 60).convert("L").save(cut)
        cut.write_bytes(cut.read_bytes()[:80])
    with pytest.raises(SourceError) as e:
        index_params_folders(params)
    assert str(e.value) == ("class folder(s) whose every image is broken (logged above; "
                            "data.max_broken_fraction lets them through, but a class needs an "
                            f"image): {root / 'shoe'}")
    # one shoe fixed: round(1 * 0.5) = 1, the one good shoe would go to test, none to train
    Image.new("L", (6, 6), 9).save(root / "shoe" / "0.png")
    with pytest.raises(SourceError) as e:
        index_params_folders(params)
    assert str(e.value) == ("data.test_fraction = 0.5 holds out every image of class folder(s) "
                            f"{root / 'shoe'} (1 image(s) left) (a class of n images holds out "
                            "int(n x 0.5 + 0.5) for test); add images or lower "
                            "data.test_fraction")
    # a second good shoe: 2 broken of 7 within 0.5, listed, and the index is written
    Image.new("L", (6, 6), 7).save(root / "shoe" / "3.png")
    assert index_params_folders(params)["data.root"]["broken"] == ["shoe/1.png", "shoe/2.png"]
    # a test_fraction that leaves the test split empty: round(3 * 0.1) + round(2 * 0.1) = 0
    params.test_fraction = 0.1
    with pytest.raises(SourceError) as e:
        index_params_folders(params)
    assert str(e.value) == (f"data.test_fraction = 0.1 leaves the test split of {root} empty "
                            "(a class of n images holds out int(n x 0.1 + 0.5) for test); raise "
                            "it or add images")
    params.test_fraction = 0.5
    # a class folder that is a symlink to a disk not mounted
    (root / "sandal").symlink_to(tmp_path / "unmounted" / "sandal")
    with pytest.raises(SourceError) as e:
        index_params_folders(params)
    assert str(e.value) == (f"{root}: symlink(s) to nothing, so folder(s) missing (a disk not "
                            f"mounted?): {root / 'sandal'}; mount it or remove the link")
    # a file link to nothing beside the class folders is not read, as any file there
    (root / "sandal").unlink()
    (root / "latest.jpg").symlink_to(tmp_path / "unmounted" / "latest.jpg")
    assert index_params_folders(params)["data.root"]["images"] == 7
    # test/ on a disk not mounted, val/ beside it: stops instead of reading val/ as test
    split_root = tmp_path / "split"
    for split in ("train", "val"):
        for cls in ("coat", "shoe"):
            (split_root / split / cls).mkdir(parents=True)
            Image.new("L", (6, 6), 1).save(split_root / split / cls / "0.png")
    (split_root / "test").symlink_to(tmp_path / "unmounted" / "test")
    params.root = str(split_root)
    with pytest.raises(SourceError) as e:
        index_params_folders(params)
    assert str(e.value).startswith(f"{split_root}: symlink(s) to nothing")


def test_index_params_folders__lists_the_files_the_build_reads_under_its_names(tmp_path,
                                                                               monkeypatch):
    # one folder linked into both train/ and test/: the build reads it once, as train/...
    # (train is walked first); the index must name its broken file the same way, or the build
    # would not leave it out. Files outside the class folders are not the build's: a broken
    # one there does not stop the index, and val/ beside test/ is not read either.
    from pipeline.atomic import write_json
    from pipeline.config import DataParams
    from pipeline.data.build import open_data
    from pipeline.data.folder_index import FOLDERS, index_params_folders

    monkeypatch.chdir(tmp_path)
    root, shared = tmp_path / "raw", tmp_path / "shared"
    shared.mkdir()
    for i in range(5):
        Image.new("L", (6, 6), 10 * i).save(shared / f"{i}.png")
    (shared / "bad.png").write_text("<html>not an image</html>")
    for split in ("train", "test", "val"):
        for cls in ("coat", "shoe"):
            (root / split / cls).mkdir(parents=True)
            Image.new("L", (6, 6), 3).save(root / split / cls / "own.png")
        (root / split / "coat" / "extra").symlink_to(shared)
    (root / "val" / "shoe" / "broken.png").write_text("no image")
    (root / "thumbnail.jpg").write_text("no image either")
    params = DataParams(source="imagefolder", root=str(root), max_broken_fraction=0.2)
    index = index_params_folders(params)
    # train 2 own + 6 shared, test 2 own (its link: a folder already read): 10 images
    assert index["data.root"]["images"] == 10
    assert index["data.root"]["broken"] == ["train/coat/extra/bad.png"]
    write_json(FOLDERS, index)
    src, _ = open_data(params, seed=0)
    assert src.broken == 1 and src.splits() == {"pretrain": 7, "train": 7, "test": 2}


def _png(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_index__dotted_keys_counted_as_in_the_tar_index_and_loader_agree(tmp_path):
    # Worked by hand. Members: a.b.c.jpg + a.b.c.json, a.b.d.jpg, 000000001.jpg + .json + .txt,
    # x.y.jpg cut short, img.2024.05.png, only.meta.json. A key ends at the last dot (as
    # img2dataset writes <key>.<ext>): 6 samples; a.b.c, a.b.d, 000000001 and img.2024.05
    # decode (4), x.y (truncated) and only.meta (no image) are broken (2). WebDataset's
    # first-dot rule would read 5 samples a, 000000001, x, img, only and 1 good (a's members
    # b.c.jpg, b.d.jpg are no image member).
    jpg = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(jpg, format="JPEG", quality=95)
    good = jpg.getvalue()
    path = tmp_path / "ext" / "00000.tar"
    path.parent.mkdir()
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
        for name, data in [("a.b.c.jpg", good), ("a.b.c.json", b"{}"), ("a.b.d.jpg", good),
                           ("000000001.jpg", good), ("000000001.json", b"{}"),
                           ("000000001.txt", b"a caption"), ("x.y.jpg", good[:len(good) // 3]),
                           ("img.2024.05.png", _png((0, 90, 0))), ("only.meta.json", b"{}")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    m, _ = index_shards(str(path.parent), split="pretrain", key="data.pretrain_shards",
                        max_broken_fraction=0.5)
    assert (m.num_samples, m.num_broken) == (4, 2)
    (entry,) = m.shards
    assert [b.key for b in entry.broken] == ["x.y", "only.meta"]
    assert entry.broken[1].why == "no image member (has json)"
    # the loader reads the same 4 samples under the same keys, once each per epoch
    no_labels(tmp_path / "sh")
    joined = pretrain_manifest(tmp_path / "sh", write_index(tmp_path / "idx", m))
    (images, keys), = list(train_loader("joined", batch_size=4, steps=1, epoch=0, seed=0,
                                        manifest=joined))
    assert sorted(keys) == ["000000001", "a.b.c", "a.b.d", "img.2024.05"]
    assert images.shape == (4, 3, 16, 16)
    # and verify-shards counts the same against the index
    assert verify_shards(tmp_path / "idx")["num_samples"] == 4


def test_dangling_symlink__left_out_by_the_build_tree_and_imagefolder(tmp_path):
    # within the budget the index lists the link as broken and the build leaves it out:
    # the tree keeps its 3 good images, the imagefolder its 4 (2 per class)
    from pipeline.data.folder_index import index_folders
    from pipeline.data.sources import ImageFolderSource, UnlabelledTree

    tree = tmp_path / "photos"
    tree.mkdir()
    for i in range(3):
        Image.new("L", (4, 4), 50 * i).save(tree / f"p{i}.png")
    (tree / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    folder = tmp_path / "labelled"
    for c in ("cat", "dog"):
        (folder / c).mkdir(parents=True)
        for i in range(2):
            Image.new("L", (4, 4), 30 * i).save(folder / c / f"{i}.png")
    (folder / "dog" / "moved.png").symlink_to(tmp_path / "elsewhere.png")
    got = index_folders({"data.unlabelled_root": str(tree), "data.root": str(folder)},
                        max_broken_fraction=0.25)
    assert got["data.unlabelled_root"]["broken"] == ["gone.jpg"]
    assert got["data.root"]["broken"] == ["dog/moved.png"]
    kept = UnlabelledTree(tree, exclude=got["data.unlabelled_root"]["broken"])
    assert (len(kept), kept.broken) == (3, 1)
    src = ImageFolderSource(folder, test_fraction=0.25,
                            exclude=frozenset(got["data.root"]["broken"]))
    # 2 images per class: int(2 x 0.25 + 0.5) = 1 test image each
    assert (src.count("train"), src.count("test"), src.broken) == (2, 2, 1)


# --- the check of a pretraining plan before build_shards (plans: tests/data/test_plan.py) ---


def test_check_before_build__queue_and_preset_named_in_one_line(caplog):
    from pipeline.config import ParamsError, from_dict
    from pipeline.data.checks import check_before_build
    from pipeline.data.plan import PretrainPlan

    p = from_dict({"data": {"source": "none", "unlabelled_root": "/p"},
                   "moco": {"K": 4096}, "augment": {"preset": "v2"}})
    photos = PretrainPlan(3, "3 in data.unlabelled_root /p", "L", "data.unlabelled_root /p")
    with pytest.raises(ParamsError) as e:
        check_before_build(p, photos)
    says(str(e.value), "'moco.K' = 4096", "allowed: < 3", "3 in data.unlabelled_root /p")
    p.moco.K = 2
    with pytest.raises(ParamsError) as e:
        check_before_build(p, photos)
    says(str(e.value), "'augment.preset' = 'v2'", "allowed: v2_grey", "1-channel",
         "mode L, data.unlabelled_root /p")
    with pytest.raises(ParamsError) as e:  # the default budget: up to 250 of the 3 images
        check_before_build(p, PretrainPlan(3, "3 in /p", "RGB", "data.unlabelled_root /p"))
    says(str(e.value), "'selection.budget' = [10, 20, 50, 100, 250]", "at most 3", "3 in /p")
    p.selection.budget = [2, 3]
    p.selection.exclude_outliers = 0.3  # round(0.9) = 1 of the 3 never picked: 2 left
    with pytest.raises(ParamsError) as e:
        check_before_build(p, PretrainPlan(3, "3 in /p", "RGB", "data.unlabelled_root /p"))
    says(str(e.value), "'selection.budget' = [2, 3]", "at most 2", "exclude_outliers 0.3")
    p.selection.exclude_outliers = 0.0
    check_before_build(p, PretrainPlan(3, "", "RGB", "data.unlabelled_root /p"))  # passes
    p.augment.preset = "v2_grey"
    caplog.set_level(logging.WARNING)
    check_before_build(p, PretrainPlan(3, "", "RGB", "data.unlabelled_root /p"))
    assert caplog.messages == [
        "augment.preset v2_grey on 3-channel pretraining images (mode RGB, "
        "data.unlabelled_root /p): the views get brightness and contrast jitter only, no "
        "saturation, hue or random grayscale, so both views of an image keep its colours and "
        "the encoder can match them by colour alone; v2 (v2_small below 64 px) adds them; keep "
        "v2_grey for grey images stored as RGB"]


def test_index_params_folders__mode_and_train_split_of_an_imagefolder(tmp_path, monkeypatch):
    # 2 classes of 5 grey images + 1 colour one in a tree: the folder is L, the tree RGB;
    # int(5 x 0.2 + 0.5) = 1 test image per class, so 8 train images
    from pipeline.config import from_dict
    from pipeline.data.folder_index import index_params_folders

    monkeypatch.chdir(tmp_path)  # no last index here
    for c in ("a", "b"):
        (tmp_path / "lab" / c).mkdir(parents=True)
        for i in range(5):
            Image.new("L", (4, 4), 20 * i).save(tmp_path / "lab" / c / f"{i}.png")
    (tmp_path / "tree").mkdir()
    Image.new("RGB", (4, 4), (9, 90, 0)).save(tmp_path / "tree" / "x.png")
    p = from_dict({"data": {"source": "imagefolder", "root": str(tmp_path / "lab"),
                            "unlabelled_root": str(tmp_path / "tree"), "test_fraction": 0.2}})
    got = index_params_folders(p.data)
    assert got["data.root"]["mode"] == "L" and got["data.root"]["train_images"] == 8
    assert got["data.unlabelled_root"]["mode"] == "RGB"


def test_index__two_processes_give_the_same_manifest(tmp_path):
    # data.build_workers: the shards are read one per process, the manifest is the same bytes
    img2dataset_shards(tmp_path / "ext", shards=3, per_shard=6, broken={2: 1}, cls=(0, 1, 2))
    spec = str(tmp_path / "ext")
    one, v1 = index_shards(spec, split="labelled", key="data.root", max_broken_fraction=0.1,
                           label_field="cls")
    two, v2 = index_shards(spec, split="labelled", key="data.root", max_broken_fraction=0.1,
                           label_field="cls", workers=2)
    assert [s.num_samples for s in two.shards] == [6, 6, 5]
    assert two.to_json() == one.to_json() and v2 == v1
