"""The loader decodes only what the crop needs: draft scale, tensor views, device batches.

Real photos (crops of scikit-learn's sample photos, ``benchmarks/sample_photos.py``) in shards
built by ``build_all``, 7 of them stored as cameras store them with EXIF orientation 2..8
(``helpers.tag_photos``). References are computed independently: boxes and reductions by hand,
views against a full PIL decode turned by ``ImageOps.exif_transpose`` and cropped by
torchvision's own PIL ``resized_crop``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tag_photos, upright_reference, write_photos
from PIL import Image

from pipeline.config import DataParams
from pipeline.data.build import build_all
from pipeline.data.external import open_image
from pipeline.data.jpeg import cut_views, decode_jpeg_bytes, reduction, upright
from pipeline.data.loader import EncodedBatch, train_loader
from pipeline.data.views import SeededRandomResizedCrop
from pipeline.seeds import derive_seed


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Shards of 40 real 320 x 240 photos kept as they are (JPEG bytes), RGB; 7 carry an EXIF
    orientation (2..8), their files' bytes kept with the tag."""
    base = tmp_path_factory.mktemp("photo-shards")
    write_photos(base / "photos", count=40, width=320, height=240)
    tagged = tag_photos(base / "photos")
    cwd = Path.cwd()
    os.chdir(base)
    try:
        ms = build_all(DataParams(source="imagefolder", root=str(base / "photos"), image_size=32,
                                  max_side=1024, test_fraction=0.2, samples_per_shard=8,
                                  shards_dir=str(base / "shards")), seed=0, progress=False)
    finally:
        os.chdir(cwd)
    kept = ms["pretrain"].build["members"]["jpg_copied"] + ms["test"].build["members"][
        "jpg_copied"]
    assert kept == 40 and len(tagged) == 7  # the tagged ones too: their bytes, not re-encoded
    assert ms["pretrain"].image_shape == (3, 240, 320)  # upright, for every tag
    return base / "shards"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / max(mse, 1e-12)))


def test_draft_scale__by_hand():
    crop = SeededRandomResizedCrop(24)
    # the smallest box side over the views decides: 100 >= 4 * 24, < 8 * 24
    assert crop.draft_scale([(0, 0, 100, 130), (5, 5, 200, 210)]) == 4
    assert crop.draft_scale([(0, 0, 47, 300)]) == 1  # 47 < 2 * 24: a full decode
    assert crop.draft_scale([(0, 0, 48, 300)]) == 2
    assert crop.draft_scale([(0, 0, 400, 400)]) == 8  # never below 1/8
    assert SeededRandomResizedCrop(224).draft_scale([(0, 0, 375, 500)]) == 1


def test_reduction__libjpeg_sizes():
    # libjpeg decodes W x H at 1/k as ceil(W / k) x ceil(H / k)
    assert reduction((500, 375), (500, 375)) == 1
    assert reduction((500, 375), (250, 188)) == 2
    assert reduction((500, 375), (125, 94)) == 4
    assert reduction((500, 375), (63, 47)) == 8
    with pytest.raises(ValueError, match="no DCT reduction"):
        reduction((500, 375), (100, 75))


def test_open_image__draft_decodes_at_the_scale_asked(tmp_path):
    (path,) = write_photos(tmp_path, count=1, width=320, height=240)
    data = path.read_bytes()
    seen = []
    im = open_image(data, reduce=lambda header: seen.append(header.size) or 4)
    assert seen == [(320, 240)] and im.size == (80, 60)
    full = np.asarray(open_image(data), dtype=np.float64)
    # a 1/4 DCT decode is close to the 4 x 4 block means of the full decode
    blocks = full.reshape(60, 4, 80, 4, 3).mean(axis=(1, 3))
    assert psnr(np.asarray(im), blocks) > 30
    png = io.BytesIO()
    Image.open(path).save(png, format="PNG")  # another format: always full size
    assert open_image(png.getvalue(), reduce=lambda _: 4).size == (320, 240)


@pytest.mark.filterwarnings("ignore:.*capabilities of TorchVision:DeprecationWarning")
def test_decode_jpeg_bytes__turned_as_exif_transpose(tmp_path):
    # torchvision's decode turned by the header's EXIF orientation (upright), on any device.
    # References: torchvision's own CPU-only apply_exif_orientation (same decoder: equal), and
    # PIL's decode turned by ImageOps.exif_transpose (the build's upright pixels before JPEG
    # members kept their bytes). PIL and torchvision each bundle a libjpeg-turbo; both use its
    # default islow IDCT and fancy upsampling, and here they agree exactly. A wheel with another
    # libjpeg release may round the chroma upsampling differently: 1 grey level is allowed.
    from torchvision.io import ImageReadMode, decode_jpeg

    from pipeline.errors import InputError

    paths = write_photos(tmp_path, count=16, width=160, height=120)
    tags = {p: 1 for p in paths} | tag_photos(tmp_path)
    blobs = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in paths]
    batch = decode_jpeg_bytes(blobs, 3, orientation=[tags[p] for p in paths])
    for path, blob, from_batch in zip(paths, blobs, batch, strict=True):
        got = decode_jpeg_bytes(blob, 3, orientation=tags[path])
        assert got.shape == (3, 120, 160) and torch.equal(got, from_batch)
        assert torch.equal(got, decode_jpeg(blob, mode=ImageReadMode.RGB,
                                            apply_exif_orientation=True))
        ref = upright_reference(path.read_bytes())
        assert np.abs(got.permute(1, 2, 0).numpy().astype(int) - ref).max() <= 1
    assert sorted(set(tags.values())) == list(range(1, 9))
    with pytest.raises(InputError, match="2 orientation"):
        decode_jpeg_bytes(blobs[:3], 3, orientation=[1, 6])
    with pytest.raises(InputError, match="1..8, got 9"):
        upright(torch.zeros(3, 2, 4, dtype=torch.uint8), 9)


def test_cut_views__reduced_box_by_hand():
    # a horizontal ramp, value = x: a box's resized view spans the box's columns
    ramp = torch.arange(256, dtype=torch.uint8).repeat(3, 64, 1)  # (3, 64, 256)
    full = cut_views(ramp, [(0, 64, 64, 128)], 8)[0]
    half = cut_views(ramp[:, ::2, ::2].contiguous(), [(0, 64, 64, 128)], 8, scale=2)[0]
    assert full.shape == half.shape == (3, 8, 8)
    # columns 64..191 in 8 bins of 16: centres 71.5, 87.5, ...; the filter is clamped at the
    # box's edges (the crop comes first), so the two outer bins move by up to 1.5 more
    centres = torch.arange(8) * 16 + 71.5
    assert torch.allclose(full[0, 0, 1:-1].float(), centres[1:-1], atol=1)
    assert torch.allclose(full[0, 0].float(), centres, atol=2)
    # the half-size image (its pixel j holds column 2j): the same bins within one more level
    assert torch.allclose(half[0, 0].float(), centres, atol=3)


def test_train_loader__draft_views_match_a_full_decode(shards, monkeypatch):
    from PIL import JpegImagePlugin

    crop = SeededRandomResizedCrop(32, scale=(0.2, 1.0))
    kw = dict(batch_size=8, steps=4, epoch=0, seed=3, crop=crop)
    drafts = []
    real_draft = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        drafts.append((self.size, size))
        return real_draft(self, mode, size)

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    fast = list(train_loader(shards / "pretrain", **kw))
    assert drafts, "no JPEG was decoded at a reduced scale"  # 32 px views of 320 x 240
    # asked for (W // k, H // k) with k in 2, 4: the views' boxes allowed no more
    assert {(w // rw, h // rh) for (w, h), (rw, rh) in drafts} <= {(2, 2), (4, 4)}
    full = list(train_loader(shards / "pretrain", draft=False, **kw))
    a = torch.cat([x for x, _ in fast]).numpy()
    b = torch.cat([x for x, _ in full]).numpy()
    assert a.shape == b.shape == (32, 2, 3, 32, 32)
    assert [k for _, ks in fast for k in ks] == [k for _, ks in full for k in ks]
    assert psnr(a, b) > 30  # the same boxes; the DCT reduction changes little


def test_train_loader__views_against_pil_reference(shards):
    # the loader's views (tensor resize) against PIL: the full photo decoded by PIL and cut
    # with torchvision's PIL resized_crop at the same seeded boxes
    from pipeline.data.shards import iter_shard, read_manifest

    crop = SeededRandomResizedCrop(32, scale=(0.2, 1.0))
    m = read_manifest(shards / "pretrain")
    batches = list(train_loader(shards / "pretrain", batch_size=8, epoch=2, seed=7,
                                steps=m.num_samples // 8, crop=crop, draft=False))
    data = {r["__key__"]: r["jpg"] for s in m.shards
            for r in iter_shard(shards / "pretrain" / s.name)}
    order = _positions(shards, seed=7, epoch=2)
    tags = []
    for views, keys in batches:
        for i, key in enumerate(keys):
            # the reference: PIL's decode turned by exif_transpose, cut at the same boxes
            image = Image.fromarray(upright_reference(data[key]))
            with Image.open(io.BytesIO(data[key])) as header:
                tags.append(header.getexif().get(0x0112, 1))
            for v in range(2):
                ref = crop(image, derive_seed("crop", 7, 2, order[key], v))
                got = views[i, v].permute(1, 2, 0).numpy()
                assert np.abs(got.astype(int) - np.asarray(ref, dtype=int)).max() <= 2
    assert len(tags) == 32 and len(set(tags)) >= 5  # tagged photos among them, most tags


def _positions(shards, *, seed, epoch):
    """Each key's position in the epoch sequence (loader.epoch_order, by hand over shards)."""
    from pipeline.data.loader import epoch_order
    from pipeline.data.shards import iter_shard, read_manifest

    m = read_manifest(shards / "pretrain")
    counts = [s.num_samples for s in m.shards]
    perm, offset = epoch_order(counts, seed=seed, epoch=epoch)
    seq = [r["__key__"] for i in perm for r in iter_shard(shards / "pretrain" /
                                                           m.shards[i].name)]
    n = len(seq)
    return {seq[(p + offset) % n]: p for p in range(n)}


def test_train_loader__device_decode_on_cpu_equals_the_workers_path(shards):
    # decode="device": the workers pass JPEG bytes and boxes; .to(cpu) decodes the batch with
    # torchvision and cuts the views: the very ops the workers run without draft
    crop = SeededRandomResizedCrop(32, scale=(0.2, 1.0))
    kw = dict(batch_size=8, steps=3, epoch=1, seed=0, crop=crop, draft=False)
    workers = list(train_loader(shards / "pretrain", **kw))
    device = list(train_loader(shards / "pretrain", decode="device", **kw))
    for (x, kx), (enc, ke) in zip(workers, device):
        assert isinstance(enc, EncodedBatch) and kx == ke == enc.keys
        assert all(j.numel() for j in enc.jpegs) and enc.boxes.shape == (8, 2, 4)
        assert torch.equal(enc.to(torch.device("cpu")), x)


def test_encoded_batch__bad_jpeg_names_the_sample():
    from pipeline.data.shards import ShardError

    bad = torch.frombuffer(bytearray(b"\xff\xd8\xff\xe0" + b"\0" * 60), dtype=torch.uint8)
    batch = EncodedBatch([bad], torch.zeros(1, 2, 4, dtype=torch.int64), [1],
                         torch.zeros(1, 2, 3, 8, 8, dtype=torch.uint8), ["k1"], ["s.tar"])
    with pytest.raises(ShardError, match=r"s\.tar: sample 'k1' does not decode on cpu"):
        batch.to(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nvjpeg)")
def test_encoded_batch__cuda_decode_close_to_cpu(shards):
    crop = SeededRandomResizedCrop(32, scale=(0.2, 1.0))
    (enc, _), = list(train_loader(shards / "pretrain", batch_size=8, steps=1, epoch=0,
                                  seed=0, crop=crop, decode="device"))
    cpu = enc.to(torch.device("cpu")).numpy()
    gpu = enc.to(torch.device("cuda")).cpu().numpy()
    assert psnr(cpu, gpu) > 35
