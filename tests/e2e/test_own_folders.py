"""Your own images, recipe 1: an unlabelled image tree + a small labelled folder, `dvc repro`.

300 generated unlabelled images (nested folders, sizes 12-40 px, square and not, grey and RGB,
PNG and JPEG, plus a hidden file, an AppleDouble file, a hidden folder and a README.txt) and a
60-image labelled ImageFolder (4 classes; train/ 40, test/ 20). The pipeline runs end to end;
the pretrain shards hold the 300 unlabelled images with label -1 plus the 40 labelled train
images; the evaluation stages see only the 60 labelled images; a second `dvc repro` reruns
nothing but the index.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import yaml
from PIL import Image
from repohelpers import STAGES, commit, file_digests, make_repo, out, params, ran, sh

from pipeline.data.shards import iter_shard, read_manifest
from pipeline.evaluate.features import load_features as read_features

pytestmark = pytest.mark.slow


def unlabelled_tree(root, n=300, seed=0):
    """``n`` images in up to three levels of folders; junk beside them (not counted)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        d = root.joinpath(*[f"d{(i >> s) % 3}" for s in range(i % 3 + 1)])
        d.mkdir(parents=True, exist_ok=True)
        w, h = int(rng.integers(12, 41)), int(rng.integers(12, 41))
        grey = i % 2 == 0
        a = rng.integers(0, 256, (h, w) if grey else (h, w, 3), dtype=np.uint8)
        Image.fromarray(a).save(d / f"im{i:03d}.{'png' if i % 3 else 'jpg'}")
    (root / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (root / "d0" / "._im000.png").write_bytes(b"\0\5\26\7 AppleDouble")
    (root / ".thumbnails").mkdir()
    (root / ".thumbnails" / "x.png").write_bytes(b"not read")
    (root / "README.txt").write_text("photos from the field trip\n")


def labelled_folder(root, seed=1):
    """train/ 4 x 10 and test/ 4 x 5 grey 20 px images, a bright quadrant per class."""
    rng = np.random.default_rng(seed)
    for split, per in (("train", 10), ("test", 5)):
        for c in range(4):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for j in range(per):
                a = rng.integers(0, 80, (20, 20), dtype=np.uint8)
                r, q = divmod(c, 2)
                a[r * 10:(r + 1) * 10, q * 10:(q + 1) * 10] += 150
                Image.fromarray(a).save(d / f"{j}.png")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    base = tmp_path_factory.mktemp("unlabelled")
    unlabelled_tree(base / "photos")
    labelled_folder(base / "labelled")
    tree = params({"data": {"source": "imagefolder", "root": str(base / "labelled"),
                            "unlabelled_root": str(base / "photos")}})
    dst = base / "repo"
    env = make_repo(dst, tree)
    first = sh(["dvc", "repro"], dst, env)
    commit(dst, env)
    return dst, env, out(first)


def test_unlabelled__repro_runs_every_stage(repo):
    _, _, text = repo
    assert ran(text) == STAGES


def test_unlabelled__pretrain_shards_hold_all_300_with_label_minus_one(repo):
    dst, _, _ = repo
    m = read_manifest(dst / "data/shards/pretrain")
    assert m.num_samples == 340 and m.label_counts == {
        "-1": 300, "0": 10, "1": 10, "2": 10, "3": 10}
    # the tree has grey and colour images: one colour image makes the whole set RGB, the
    # labelled grey ones included (three equal channels), and every split agrees
    assert m.mode == "RGB" and m.image_shape == (3, 16, 16)
    assert read_manifest(dst / "data/shards/train").mode == "RGB"
    rec = m.build["unlabelled"]
    assert rec["images"] == 300 and "skipped" not in rec  # junk must not change the manifest
    # .DS_Store and the .thumbnails folder (hidden), ._im000.png (AppleDouble), README.txt:
    # counted in the folder index
    folders = json.loads((dst / "data/index/folders.json").read_text())
    assert folders["data.unlabelled_root"]["skipped"] == {"appledouble": 1, "hidden": 2,
                                                          "not_image": 1}
    assert folders["data.unlabelled_root"]["images"] == 300
    assert folders["data.root"]["images"] == 60 and folders["data.root"]["skipped"] == {}
    keys, labels = [], []
    for s in m.shards:
        for r in iter_shard(dst / "data/shards/pretrain" / s.name):
            keys.append(r["__key__"])
            labels.append(int(r["cls"]))
    unl = [k for k, y in zip(keys, labels) if y == -1]
    assert len(unl) == 300 and all(k.startswith("u") for k in unl)
    assert len(set(keys)) == 340


def test_unlabelled__skipped_files_counted_in_the_log(repo):
    _, _, text = repo
    assert re.search(r"unlabelled tree \S+photos: 300 images, skipped 1 appledouble, "
                     r"2 hidden, 1 not_image", text), text[-3000:]


def test_unlabelled__evaluation_uses_only_labelled_images(repo):
    dst, _, _ = repo
    embed = json.loads((dst / "eval/metrics/embed.json").read_text())
    assert embed["train_images"] == 40 and embed["test_images"] == 20
    pre = json.loads((dst / "eval/metrics/pretrain.json").read_text())
    assert pre["pretrain_images"] == 340 and pre["steps"] == 340 // 32
    for name in ("knn", "linear"):
        assert 0 <= json.loads((dst / f"metrics/{name}.json").read_text())["top1"] <= 100
    assert (dst / "reports/report.html").is_file()


def test_unlabelled__second_repro_runs_only_the_index(repo):
    dst, env, _ = repo
    assert ran(out(sh(["dvc", "repro"], dst, env))) == ["index_shards"]


def test_unlabelled__queue_longer_than_the_tree_is_refused_before_the_build(repo):
    # check_params cannot count an unlabelled tree; index_shards counts it (40 labelled train
    # images + 300 in the tree) and refuses K = 340 before DVC deletes the shards or any of
    # pretrain's or embed's outputs
    dst, env, _ = repo
    kept = ["data", "models", "features", "metrics", "plots"]
    before = {d: file_digests(dst / d) for d in kept}
    good = (dst / "params.yaml").read_text()
    tree = yaml.safe_load(good)
    tree["moco"]["K"] = 340
    (dst / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    try:
        res = sh(["dvc", "repro"], dst, env, ok=False)
    finally:
        (dst / "params.yaml").write_text(good)
    text = out(res)
    assert res.returncode != 0 and "Traceback" not in text
    assert ran(text) == ["check_params", "index_shards"], text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert errors == [
        "error: params.yaml: 'moco.K' = 340 is invalid; allowed: < 340, the number of pretraining "
        f"images (40 of data.source imagefolder, data.root {dst.parent / 'labelled'} + 300 in "
        f"data.unlabelled_root {dst.parent / 'photos'}; counted by index_shards): a queue of "
        "K >= N keys holds keys of the very images in the batch as negatives (moco#146); lower "
        "moco.K or add images"], text[-3000:]
    assert {d: file_digests(dst / d) for d in kept} == before
    # K back at its value: only check_params (params.yaml changed again, its stamp did not) and
    # the index run
    assert ran(out(sh(["dvc", "repro"], dst, env))) == ["check_params", "index_shards"]


def test_unlabelled__missing_tree_refused_before_the_shards_are_deleted(repo):
    # index_shards lists the folder before build_shards runs: a typo in the path stops
    # `dvc repro` with one line, and the built shards stay
    dst, env, _ = repo
    before = file_digests(dst / "data/shards")
    good = (dst / "params.yaml").read_text()
    tree = yaml.safe_load(good)
    tree["data"]["unlabelled_root"] = str(dst.parent / "fotos")
    (dst / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    try:
        res = sh(["dvc", "repro"], dst, env, ok=False)
    finally:
        (dst / "params.yaml").write_text(good)
    text = out(res)
    assert res.returncode != 0 and "Traceback" not in text
    assert ran(text) == ["check_params", "index_shards"], text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: SourceError: data.unlabelled_root = '{dst.parent / 'fotos'}': "
                      "not a directory"], text[-3000:]
    assert file_digests(dst / "data/shards") == before


def test_unlabelled__unreadable_image_refused_before_the_shards_are_deleted(repo):
    # a web page saved as .jpg: index_shards decodes every image and stops `dvc repro` with one
    # line naming the file (1 of 301 is over data.max_broken_fraction 0.001), before
    # build_shards deletes the built shards
    dst, env, _ = repo
    before = file_digests(dst / "data/shards")
    bad = dst.parent / "photos" / "d2" / "page.jpg"
    bad.write_bytes(b"<html><body>403 Forbidden</body></html>")
    try:
        res = sh(["dvc", "repro"], dst, env, ok=False)
    finally:
        bad.unlink()
    text = out(res)
    assert res.returncode != 0 and "Traceback" not in text
    assert ran(text)[-1] == "index_shards", text[-3000:]  # the index stopped the run
    assert set(ran(text)) <= {"check_params", "index_shards"}, text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: SourceError: data.unlabelled_root = '{dst.parent / 'photos'}': "
                      f"1 unreadable image(s): {bad} (UnidentifiedImageError); 1 of 301 images "
                      "broken = 0.33 % > data.max_broken_fraction 0.001 (fix or remove them, or "
                      "raise it)"], text[-3000:]
    assert file_digests(dst / "data/shards") == before
    # without the file the listing is the one before: nothing after the index reruns
    again = ran(out(sh(["dvc", "repro"], dst, env)))
    assert "index_shards" in again and set(again) <= {"check_params", "index_shards"}, again


def test_unlabelled__broken_files_within_the_budget_are_left_out(repo):
    # data.max_broken_fraction 0.01: a download cut short past its header and a web page saved
    # as .jpg (2 of 302) are logged, listed in data/index/folders.json and left out; the shards
    # then hold the same bytes as without them, manifests included, so nothing after
    # build_shards reruns
    dst, env, _ = repo
    before = file_digests(dst / "data/shards")
    photos = dst.parent / "photos"
    jpeg = (photos / "d0" / "im000.jpg").read_bytes()
    cut, page = photos / "d0" / "zz_cut.jpg", photos / "d0" / "zz_page.jpg"
    cut.write_bytes(jpeg[: len(jpeg) // 2])
    page.write_bytes(b"<html>403 Forbidden</html>")
    tree = yaml.safe_load((dst / "params.yaml").read_text())
    tree["data"]["max_broken_fraction"] = 0.01
    (dst / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    try:
        text = out(sh(["dvc", "repro", "build_shards"], dst, env))
        assert ran(text) == ["check_params", "index_shards", "build_shards"], text[-3000:]
        assert ("data.unlabelled_root: 2 of 302 images skipped as broken "
                "(data.max_broken_fraction 0.01)") in text, text[-3000:]
        # the stage's summary line counts them beside the shard sets
        assert "data.unlabelled_root: listed (302 images, 2 broken skipped)" in text
        folders = json.loads((dst / "data/index/folders.json").read_text())
        assert folders["data.unlabelled_root"]["broken"] == ["d0/zz_cut.jpg", "d0/zz_page.jpg"]
        assert folders["data.unlabelled_root"]["images"] == 302
        m = read_manifest(dst / "data/shards/pretrain")
        assert m.build["unlabelled"]["images"] == 300
        assert file_digests(dst / "data/shards") == before
    finally:
        cut.unlink()
        page.unlink()
        sh(["git", "checkout", "params.yaml"], dst, env)
    sh(["dvc", "repro", "build_shards"], dst, env)
    assert file_digests(dst / "data/shards") == before


def test_unlabelled__an_image_added_to_the_tree_rebuilds_and_retrains(repo):
    dst, env, _ = repo
    Image.fromarray(np.full((20, 20), 99, np.uint8)).save(dst.parent / "photos/d1/new.png")
    # up to pretrain: what runs after it follows from pretrain's new outputs (dvc.yaml deps)
    text = out(sh(["dvc", "repro", "pretrain"], dst, env))
    assert ran(text) == ["index_shards", "build_shards", "check_data", "pretrain"], text[-3000:]
    m = read_manifest(dst / "data/shards/pretrain")
    assert m.num_samples == 341 and m.build["unlabelled"]["images"] == 301
    assert json.loads((dst / "eval/metrics/pretrain.json").read_text())["pretrain_images"] == 341
    # a README beside the images is skipped and counted: the shards are rebuilt with the same
    # bytes, so pretraining does not rerun
    (dst.parent / "photos/d1/notes.txt").write_text("more photos soon\n")
    assert ran(out(sh(["dvc", "repro", "pretrain"], dst, env))) == ["index_shards",
                                                                     "build_shards"]
    commit(dst, env, "one more photo")


# --- recipe 3: no labels at all ---------------------------------------------------------------


@pytest.fixture(scope="module")
def nolabels(tmp_path_factory):
    base = tmp_path_factory.mktemp("nolabels")
    unlabelled_tree(base / "photos", n=120, seed=3)
    tree = params({"data": {"source": "none", "unlabelled_root": str(base / "photos")},
                   "mlflow": {"enabled": True}})  # the encoder's registration is checked
    dst = base / "repo"
    env = make_repo(dst, tree)
    return dst, env, out(sh(["dvc", "repro", "data_insights"], dst, env))


def test_no_labels__repro_data_insights_gives_the_encoder_and_the_insights(nolabels):
    dst, _, text = nolabels
    assert ran(text) == ["check_params", "index_shards", "build_shards", "check_data", "pretrain",
                         "data_insights"]
    # near-duplicates and outliers of the 120 unlabelled images, no labels needed
    details = json.loads((dst / "eval/data_insights.json").read_text())
    assert details["images"] == 120 and details["parts"] == {"built": 120, "read_in_place": 0}
    assert len(details["outliers"]) == 120  # insights.listed 1000 >= 120: every image ranked
    assert json.loads((dst / "eval/metrics/data_insights.json").read_text())["images"] == 120
    assert json.loads((dst / "runs/data_insights.json").read_text())["run_id"]
    assert (dst / "models/encoder.pt").is_file() and (dst / "models/encoder.json").is_file()
    assert "kNN monitor off: no labelled train or test images" in text
    # logged and registered in MLflow, the pretraining images as its input example
    assert "could not log" not in text and "could not register" not in text, text[-3000:]
    assert json.loads((dst / "runs/pretrain.json").read_text())["model_version"] == "1"
    assert read_manifest(dst / "data/shards/pretrain").num_samples == 120
    assert read_manifest(dst / "data/shards/train").num_samples == 0
    assert json.loads((dst / "eval/metrics/pretrain.json").read_text())["pretrain_images"] == 120


def test_no_labels__repro_completes_with_the_report(nolabels):
    # the evaluation stages are skipped cleanly (exit 0), each output saying why; the report
    # shows what exists: the label-free numbers, near-duplicates and outliers
    dst, env, _ = nolabels
    text = out(sh(["dvc", "repro"], dst, env))
    assert "Traceback" not in text and "error:" not in text, text[-3000:]
    assert ran(text) == ["index_shards", "check_eval", "embed", "baselines", "knn", "linear",
                         "label_efficiency", "select_labels", "report"], text[-3000:]
    for stage in ("embed", "baselines", "knn", "linear", "label_efficiency"):
        assert f"{stage}: skipped: no labelled train or test images (data.source none)" in text
        assert json.loads((dst / f"metrics/{stage}.json").read_text()) == {}
        assert json.loads((dst / f"runs/{stage}.json").read_text())["run_id"] is None
    assert (dst / "plots/linear.tsv").read_text() == ""
    assert read_features(dst / "features/test.pt").features.shape[0] == 0
    html = (dst / "reports/report.html").read_text()
    assert "Evaluation with labels skipped: no labelled train or test images" in html
    assert "What the embeddings say about the data" in html
    assert "Near-duplicates" in html or "near-duplicate" in html
