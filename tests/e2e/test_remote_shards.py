"""Your own images, recipe 2: img2dataset-layout shards on a web server, inside `dvc repro`.

``python -m http.server`` on 127.0.0.1 serves four pretraining shards (50 samples each: .jpg +
.json + .txt) and two labelled shards (40 samples each, with .cls). The pipeline pretrains from
the URL without storing any copy of the pretraining images; a second `dvc repro` and a
`dvc exp run` rerun nothing the remote decides; replacing one remote shard reruns pretraining
and what follows; a replacement with 1 broken image in 200 is accepted and counted (metrics,
MLflow); one with 50 broken stops `dvc repro` with one line naming the shard and a key, every
previous output intact. Tests run in file order on one repo. The repro targets stop at ``knn``:
only the index, pretraining and the labelled build read the URLs; the stages after ``knn``
read local files alone and are run end to end by the other e2e files.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import yaml
from helpers import img2dataset_shards
from repohelpers import STAGES, commit, make_repo, out, params, ran, sh

from pipeline.data.shards import read_manifest

pytestmark = pytest.mark.slow

TARGET = "knn"  # and what it depends on: every stage that reads the URLs
UP_TO_KNN = [s for s in STAGES if s in {"check_params", "index_shards", "build_shards",
                                        "check_data", "pretrain", "data_insights", "check_eval",
                                        "embed", "knn"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = tmp_path_factory.mktemp("srv")
    img2dataset_shards(srv / "pre", shards=4, per_shard=50, seed=10)
    img2dataset_shards(srv / "lab", shards=2, per_shard=40, cls=(0, 1), seed=20, colour=False)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", str(srv)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    yield srv, f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


def replace_shard(srv, index: int, *, per_shard: int, broken: int, seed: int) -> None:
    """A new ``pre/0000<index>.tar`` on the server, swapped in atomically (new mtime)."""
    time.sleep(1.1)  # Last-Modified has a resolution of one second
    tmp = srv / "tmp"
    (path,) = img2dataset_shards(tmp, shards=1, per_shard=per_shard, start=index,
                                 broken={index: broken}, seed=seed)
    os.replace(path, srv / "pre" / path.name)


@pytest.fixture(scope="module")
def repo(tmp_path_factory, server):
    _, url = server
    tree = params({"data": {"source": "webdataset", "root": f"{url}/lab/{{00000..00001}}.tar",
                            "label_field": "cls", "test_fraction": 0.25,
                            "pretrain_labelled": False,
                            "pretrain_shards": f"{url}/pre/{{00000..00003}}.tar",
                            "max_broken_fraction": 0.01},
                   "mlflow": {"enabled": True}})  # latest_run reads the stages' runs
    dst = tmp_path_factory.mktemp("remote") / "repo"
    env = make_repo(dst, tree)
    first = sh(["dvc", "repro", TARGET], dst, env)
    commit(dst, env)
    return dst, env, out(first)


def metrics(dst, name):
    """Every number of a stage (``metrics/<name>.json`` holds only its headline)."""
    return json.loads((dst / f"eval/metrics/{name}.json").read_text())


def latest_run(env, stage):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = c.get_experiment_by_name("moco-pipeline")
    runs = [r for r in c.search_runs([exp.experiment_id], max_results=500)
            if r.data.tags.get("stage") == stage]
    return max(runs, key=lambda r: r.info.start_time)


def test_remote__repro_pretrains_from_the_url(repo, server):
    srv, url = server
    dst, _, text = repo
    assert ran(text) == UP_TO_KNN
    idx = read_manifest(dst / "data/index/pretrain")
    served = sorted((srv / "pre").glob("*.tar"))
    assert [s.url for s in idx.shards] == [f"{url}/pre/{p.name}" for p in served]
    assert [s.sha256 for s in idx.shards] == [
        hashlib.sha256(p.read_bytes()).hexdigest() for p in served]
    assert metrics(dst, "pretrain")["pretrain_images"] == 200
    assert metrics(dst, "pretrain")["broken_images_skipped"] == 0
    assert metrics(dst, "pretrain")["steps"] == 200 // 32
    # the labelled shards (.cls) serve evaluation: 80 samples, 4 classes, 25 % held out
    assert metrics(dst, "embed")["train_images"] == 60
    assert metrics(dst, "embed")["test_images"] == 20


def test_remote__no_copy_of_the_pretraining_images_on_disk(repo, server):
    srv, _ = server
    dst, _, _ = repo
    from webdataset import tarfile_samples

    jpegs = [r["jpg"] for p in sorted((srv / "pre").glob("*.tar"))
             for r in tarfile_samples([{"url": str(p)}])]
    assert len(jpegs) == 200
    shard_hashes = {hashlib.sha256(p.read_bytes()).hexdigest() for p in (srv / "pre").glob("*")}
    assert read_manifest(dst / "data/shards/pretrain").num_samples == 0
    for path in dst.rglob("*"):  # the workspace, .dvc/cache and mlartifacts included
        if not path.is_file() or path.suffix == ".py":
            continue
        data = path.read_bytes()
        assert hashlib.sha256(data).hexdigest() not in shard_hashes, path
        assert not any(j in data for j in jpegs), f"{path} holds a pretraining image"


def test_remote__second_repro_and_exp_run_rerun_nothing_downstream(repo):
    dst, env, _ = repo
    again = out(sh(["dvc", "repro", TARGET], dst, env))
    assert ran(again) == ["index_shards"]
    assert "index pretrain: 4 shards (0 read, 4 unchanged)" in again
    exp = out(sh(["dvc", "exp", "run", TARGET, "-S", "knn.k=3"], dst, env))
    assert ran(exp) == ["check_params", "index_shards", "knn"], exp[-3000:]
    commit(dst, env, "knn.k=3")


def test_remote__respelled_url_reruns_nothing(repo, server):
    # the same four shards named by a directory listing instead of braces: the index keeps
    # its bytes (it holds the URLs, not the spelling), so neither build_shards, check_data,
    # pretrain nor the report (which lists only the data keys it shows) rerun
    _, url = server
    dst, env, _ = repo
    good = (dst / "params.yaml").read_text()
    tree = yaml.safe_load(good)
    tree["data"]["pretrain_shards"] = f"{url}/pre/"
    (dst / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    try:
        text = out(sh(["dvc", "repro", TARGET], dst, env))
    finally:
        (dst / "params.yaml").write_text(good)
    assert ran(text) == ["check_params", "index_shards"], text[-3000:]
    assert "index pretrain: 4 shards (0 read, 4 unchanged)" in text
    assert ran(out(sh(["dvc", "repro", TARGET], dst, env))) == ["check_params", "index_shards"]


def test_remote__replaced_shard_with_one_broken_reruns_pretraining_counted(repo, server):
    srv, url = server
    dst, env, _ = repo
    replace_shard(srv, 3, per_shard=200, broken=1, seed=30)
    # up to pretrain: the stages after it follow from its outputs (dvc.yaml deps)
    text = out(sh(["dvc", "repro", "pretrain"], dst, env))
    assert ran(text) == ["index_shards", "check_data", "pretrain"], text[-3000:]
    assert "index pretrain: 4 shards (1 read, 3 unchanged)" in text
    m = metrics(dst, "pretrain")
    assert m["pretrain_images"] == 150 + 199 and m["broken_images_skipped"] == 1
    assert latest_run(env, "pretrain").data.metrics["final_broken_images_skipped"] == 1
    assert latest_run(env, "index_shards").data.metrics["pretrain_broken_skipped"] == 1
    (bad,) = [s for s in read_manifest(dst / "data/index/pretrain").shards if s.broken]
    assert bad.url == f"{url}/pre/00003.tar" and bad.broken[0].key == "000030000"
    commit(dst, env, "shard 3 replaced")


def test_remote__fifty_broken_in_two_hundred_refused_with_one_line(repo, server):
    srv, url = server
    dst, env, _ = repo
    before = {f: hashlib.sha256((dst / f).read_bytes()).hexdigest()
              for f in ("models/encoder.pt", "data/index/pretrain/manifest.json",
                        "metrics/pretrain.json")}
    replace_shard(srv, 3, per_shard=200, broken=50, seed=31)
    res = sh(["dvc", "repro", TARGET], dst, env, ok=False)
    text = out(res)
    assert res.returncode != 0 and ran(text) == ["index_shards"], text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, text[-3000:]
    assert f"{url}/pre/00003.tar: 50 of 200 samples undecodable, first key '000030000'" in (
        errors[0]) and "data.max_broken_fraction" in errors[0]
    assert "Traceback" not in text
    assert before == {f: hashlib.sha256((dst / f).read_bytes()).hexdigest() for f in before}
