"""What the data refutes is refused in `index_shards`, before `build_shards` deletes anything.

One tiny repo, built once by `dvc repro embed` (every stage that writes data/, models/ and
features/; a refusal in index_shards stops the stages after them alike): a labelled WebDataset
set (two local shards of 40 grey 16 px samples, four classes, the label a `.json` field) beside
an unlabelled folder of 30 grey photos. Then, one at a time: `moco.K` equal to the number of
pretraining images, labels the build would refuse (-5, 1.5, a string among integers), a colour
`augment.preset` on the grey images. Each stops `dvc repro` in `index_shards` with one error
line naming the key, the rule and the data, and every file under data/, models/, features/ and
metrics/ keeps its sha256. `v2_grey` on images that turn RGB runs, with one warning line. Last,
docs/data.md's caveat: a photo rewritten with the same size and mtime is not seen until it is
touched. Tests run in file order; each puts back what it changed.

The numbers, by hand: each shard holds 10 samples of each class (i % 4), so 20 per class;
data.test_fraction 0.25 holds out int(20 x 0.25 + 0.5) = 5 per class: train 60, test 20. The
pretraining images are train (60, data.pretrain_labelled) + the 30 photos = 90.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import img2dataset_shards, says
from PIL import Image
from repohelpers import file_digests, make_repo, out, params, ran, sh

pytestmark = pytest.mark.slow
KEPT = ("data", "models", "features", "metrics")
N_PRETRAIN = 60 + 30


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    base = tmp_path_factory.mktemp("refusals")
    img2dataset_shards(base / "lab", shards=2, per_shard=40, seed=20, colour=False)
    rng = np.random.default_rng(5)
    (base / "photos").mkdir()
    for i in range(30):
        # stored, not deflated: a rewrite with other pixels keeps the byte size
        Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(
            base / "photos" / f"p{i:02d}.png", compress_level=0)
    tree = params({"data": {"source": "webdataset", "root": str(base / "lab"),
                            "label_field": "label", "test_fraction": 0.25,
                            "unlabelled_root": str(base / "photos")}})
    dst = base / "repo"
    env = make_repo(dst, tree)
    first = out(sh(["dvc", "repro", "embed"], dst, env))
    assert "embed" in ran(first), first[-3000:]
    assert json.loads((dst / "eval/metrics/pretrain.json").read_text())["pretrain_images"] == (
        N_PRETRAIN)
    return dst, env, base


def digests(dst: Path) -> dict[str, dict[str, str]]:
    return {d: file_digests(dst / d) for d in KEPT}


@contextmanager
def params_changed(dst: Path, env: dict, **changes):
    """params.yaml with ``section__key=value`` changes, put back afterwards (and check_params'
    lock entry with it, so the next `dvc repro` does not rerun it)."""
    good = (dst / "params.yaml").read_text()
    tree = yaml.safe_load(good)
    for name, value in changes.items():
        sec, key = name.split("__")
        tree[sec][key] = value
    (dst / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    try:
        yield
    finally:
        (dst / "params.yaml").write_text(good)
        sh(["dvc", "repro", "check_params"], dst, env)


@contextmanager
def label_changed(shard: Path, key: str, label):
    """``shard`` rewritten with sample ``key``'s ``.json`` label set to ``label``; put back."""
    original = shard.read_bytes()
    with tarfile.open(fileobj=io.BytesIO(original)) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as t:
        for m, data in members:
            if m.name == f"{key}.json":
                data = json.dumps({**json.loads(data), "label": label}).encode()
                m.size = len(data)
            t.addfile(m, io.BytesIO(data))
    try:
        yield
    finally:
        shard.write_bytes(original)


def refused(dst: Path, env: dict) -> tuple[list[str], str]:
    """`dvc repro` that must fail: (the stages it ran, its one error line)."""
    res = sh(["dvc", "repro"], dst, env, ok=False)
    text = out(res)
    assert res.returncode != 0 and "Traceback" not in text, text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, text[-3000:]
    return ran(text), errors[0]


def test_refusal__queue_as_long_as_the_pretraining_images(repo):
    dst, env, base = repo
    before = digests(dst)
    with params_changed(dst, env, moco__K=N_PRETRAIN):
        stages, error = refused(dst, env)
    assert stages == ["check_params", "index_shards"]
    assert error.startswith(f"error: params.yaml: 'moco.K' = {N_PRETRAIN} "), error
    says(error, f"allowed: < {N_PRETRAIN}",
         f"60 of data.source webdataset, data.root {base / 'lab'}",
         f"+ 30 in data.unlabelled_root {base / 'photos'}")
    assert digests(dst) == before
    with params_changed(dst, env, moco__K=N_PRETRAIN - 1):  # one less passes the index
        assert ran(out(sh(["dvc", "repro", "index_shards"], dst, env))) == [
            "check_params", "index_shards"]


@pytest.mark.parametrize(("label", "why"), [
    (-5, ("label -5 is below -1", "data.label_field 'label'")),
    (1.5, ("field 'label' is 1.5", "not an integer or a string", "data.label_field 'label'")),
    ("cat", None),  # among integers
])
def test_refusal__labels_the_build_would_refuse(repo, label, why):
    dst, env, base = repo
    shard = base / "lab" / "00001.tar"
    before = digests(dst)
    with label_changed(shard, "000010003", label):
        stages, error = refused(dst, env)
    assert stages == ["index_shards"]
    assert error.startswith(f"error: ShardError: {shard}: "), error
    if why is None:
        says(error, "integers and strings mixed", "sample '000010000' has 0",
             "'000010003' 'cat'", "data.label_field 'label'")
    else:
        says(error, "sample '000010003'", *why)
    assert digests(dst) == before


def test_refusal__colour_preset_on_grey_images(repo):
    dst, env, base = repo
    before = digests(dst)
    with params_changed(dst, env, augment__preset="v2"):
        stages, error = refused(dst, env)
    assert stages == ["check_params", "index_shards"]
    assert error.startswith("error: params.yaml: 'augment.preset' = 'v2' "), error
    says(error, "allowed: v2_grey", "1-channel", f"mode L, data.source webdataset, data.root "
         f"{base / 'lab'} and data.unlabelled_root {base / 'photos'}")
    assert digests(dst) == before


def test_grey_preset_on_colour_images__runs_with_one_warning(repo):
    # one RGB photo makes the pretraining images RGB (the folder rule): v2_grey still runs,
    # and index_shards says once what its views lack
    dst, env, base = repo
    photo = base / "photos" / "colour.png"
    Image.new("RGB", (16, 16), (200, 30, 30)).save(photo)
    try:
        text = out(sh(["dvc", "repro", "index_shards"], dst, env))
    finally:
        photo.unlink()
    warnings = [ln.split(": ", 1)[1] for ln in text.splitlines()
                if re.search(r" WARNING pipeline\.data\.checks: ", ln)]
    assert len(warnings) == 1, text[-3000:]
    says(warnings[0], "augment.preset v2_grey on 3-channel pretraining images", "mode RGB, "
         f"data.source webdataset, data.root {base / 'lab'} and data.unlabelled_root "
         f"{base / 'photos'}", "v2 (v2_small below 64 px) adds them")
    # without the photo, the listing is the first one again: nothing after the index reruns
    assert ran(out(sh(["dvc", "repro", "embed"], dst, env))) == ["index_shards"]


def test_same_size_and_mtime_rewrite__unseen_until_touched(repo):
    # docs/data.md: the folder listing, like DVC and git, trusts a file's size and mtime
    dst, env, base = repo
    photo = base / "photos" / "p00.png"
    original, st = photo.read_bytes(), photo.stat()
    shards = file_digests(dst / "data/shards")
    Image.fromarray(np.full((16, 16), 7, np.uint8)).save(photo, compress_level=0)
    os.utime(photo, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert photo.stat().st_size == st.st_size and photo.read_bytes() != original
    try:
        # not seen: the listing is the same, nothing is rebuilt
        assert ran(out(sh(["dvc", "repro", "build_shards"], dst, env))) == ["index_shards"]
        assert file_digests(dst / "data/shards") == shards
        # without the folder index every image is decoded again, but the index written is the
        # same: still nothing rebuilt
        (dst / "data/index/folders.json").unlink()
        text = out(sh(["dvc", "repro", "build_shards"], dst, env))
        assert ran(text) == ["index_shards"] and "images not read again" not in text, text
        # touched: the listing changes and build_shards reads the new pixels
        sh(["touch", str(photo)], dst, env)
        assert ran(out(sh(["dvc", "repro", "build_shards"], dst, env))) == [
            "index_shards", "build_shards"]
        assert file_digests(dst / "data/shards") != shards
    finally:
        photo.write_bytes(original)
    # the photo back (with a new mtime): the first build's shards again, byte for byte
    assert ran(out(sh(["dvc", "repro", "build_shards"], dst, env))) == [
        "index_shards", "build_shards"]
    assert file_digests(dst / "data/shards") == shards
