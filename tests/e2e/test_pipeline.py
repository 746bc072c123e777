"""The whole DVC pipeline at small scale on real Fashion-MNIST (configs/ci.yaml).

A copy of the working tree becomes a fresh git repo in tmp; `configs/ci.yaml` replaces
params.yaml (so DVC sees every value); MLflow logs to a throwaway SQLite database. Then: every
accuracy is far above chance, the raw-pixel and MoCo kNN numbers equal a numpy reference
computed from the original idx files, a second `dvc repro` runs only the (always_changed)
index_shards stage, which has nothing to index here, `dvc exp run -S knn.k=...` reruns only knn
and report, `-S pretrain.lr=...` reruns pretrain and everything after it (not build_shards or
baselines), and every executed stage left a FINISHED MLflow run (index_shards logs none
without shards). The encoder (#30): each pretraining registers a version of `moco-encoder`; the
champion loads in a fresh process and gives the features of `features/test.pt` bit for bit; it
moves only for a higher linear top-1.
"""

import gzip
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from repohelpers import STAGES as ALL_STAGES
from repohelpers import commit, make_repo, params, ran, sh
from repohelpers import out as text_of

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
STAGES = ALL_STAGES[2:]  # after check_params and index_shards
INDEX = "index_shards"  # always_changed: runs at every `dvc repro`, changes nothing here

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST not installed "
                                 "(apt-get install dataset-fashion-mnist; `make setup` does)")]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    dst = tmp_path_factory.mktemp("repo")
    # configs/ci.yaml as params.yaml; the database outside the repo; one thread per stage as
    # the other e2e files (pretrain.num_threads is 1 in ci.yaml already; under `make test`'s
    # workers, a stage on every core spins against the other files' stages)
    env = make_repo(dst, params({}, tiny=None), mlflow=tmp_path_factory.mktemp("mlflow")
                    / "ci-mlflow.db")
    output = text_of(sh(["dvc", "repro"], dst, env))
    commit(dst, env)
    return dst, env, output


def test_pipeline__all_stages_run_with_sane_metrics(repo):
    dst, _, out = repo
    # params validated before any output is touched
    assert ran(out) == ["check_params", INDEX, *STAGES]
    m = {n: json.loads((dst / f"eval/metrics/{n}.json").read_text())
         for n in ("pretrain", "embed", "baselines", "knn", "linear")}
    for name, metrics in m.items():
        for k, v in metrics.items():
            assert isinstance(v, (int, float)), f"eval/metrics/{name}.json: {k} is not numeric"
    # metrics/<stage>.json: a few of those numbers, the same values (baselines' renamed)
    head = {n: json.loads((dst / f"metrics/{n}.json").read_text()) for n in m}
    assert head["knn"]["top1"] == m["knn"]["top1"] and "top5" not in head["knn"]
    assert head["baselines"]["pixels_linear"] == m["baselines"]["raw_pixels_linear_top1"]
    assert m["embed"]["train_images"] == 2000 and m["embed"]["test_images"] == 500
    # the report's throughput table reads wall_time_s of every evaluated stage
    for name in ("pretrain", "embed", "baselines", "knn", "linear"):
        assert head[name]["wall_time_s"] > 0, f"metrics/{name}.json has no wall time"
    # both splits' images over both extraction times: between the two per-split rates
    rates = (m["embed"]["train_images_per_s"], m["embed"]["test_images_per_s"])
    assert min(rates) <= m["embed"]["images_per_s"] <= max(rates)
    # Chance: the 500 test images are stratified, 50 per class (checked on the raw labels in
    # test_pipeline__knn_numbers_equal_a_numpy_reference), so a classifier whose predictions do
    # not depend on the image (collapsed features, labels misaligned with features) scores
    # Binomial(500, 0.1) / 500 = 10 % +- 1.34 % (one sd): 25 % is 11 sd above chance. The CI
    # recipe measures kNN 55.2, linear 66.8, raw pixels 71.8, random encoder 58.4 (2026-12-01).
    for name, key in (("knn", "top1"), ("linear", "top1"), ("baselines", "raw_pixels_top1"),
                      ("baselines", "random_encoder_top1")):
        assert 25 < m[name][key] <= 100, f"eval/metrics/{name}.json: {key} = {m[name][key]}"
    assert m["pretrain"]["steps"] == 2 * (2048 // 64)
    # `dvc repro` ends with the headline numbers and where the report is (the report stage);
    # index_shards says it has nothing to index instead of counting 0 images; the raw-pixel kNN
    # beside MoCo's is the tuned one (k and T chosen on held-out train images), as top1.knn.pixels
    lines = out.splitlines()
    for want in (f"kNN top-1 {m['knn']['top1']:.2f} % (raw pixels "
                 f"{m['baselines']['raw_pixels_knn_tuned_top1']:.2f} %",
                 f"linear top-1 {m['linear']['top1']:.2f} %", "report: reports/report.html"):
        assert any(ln.startswith(want) for ln in lines), want
    assert "index_shards: nothing to index" in out and '"images": 0' not in out
    assert (dst / "reports/report.html").stat().st_size > 10_000
    from pipeline.report.check import check_html
    from pipeline.report.document import NOT_AVAILABLE

    assert check_html(dst / "reports/report.html") == []
    # every number the report shows is read from a stage's metrics by name: a metric renamed on
    # either side renders "not available" (the report's only sign of a missing number)
    md = (dst / "reports/report.md").read_text()
    assert [ln for ln in md.splitlines() if NOT_AVAILABLE in ln] == []


# a fresh process: the champion from the registry, the embed stage's preprocessing, 10 images
LOAD_CHAMPION = """
import sys, torch, mlflow
from pipeline.data.views import build_eval_transform
from pipeline.data.eval_loader import eval_loader
uri = "models:/moco-encoder@champion"
encoder = mlflow.pytorch.load_model(uri)
pre = mlflow.models.get_model_info(uri).metadata["preprocessing"]
tf = build_eval_transform(pre["image_size"], pre["mean"], pre["std"])
images, _, keys = next(iter(eval_loader("data/shards/test", transform=tf, batch_size=10,
                                        max_images=10)))
with torch.no_grad():
    torch.save({"features": encoder(images), "keys": list(keys)}, sys.argv[1])
"""


def registry(env):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    versions = {int(v.version): v for v in client.search_model_versions("name = 'moco-encoder'")}
    return client, versions, client.get_registered_model("moco-encoder").aliases


def test_pipeline__registry_version_aliases_and_champion_features_bit_identical(repo, tmp_path):
    dst, env, _ = repo
    import torch

    from pipeline.evaluate.features import load_features

    client, versions, aliases = registry(env)
    assert sorted(versions) == [1] and aliases == {"champion": 1, "newest": 1}
    rec = json.loads((dst / "runs/pretrain.json").read_text())
    linear = json.loads((dst / "metrics/linear.json").read_text())
    assert versions[1].run_id == rec["run_id"] and rec["model_version"] == "1"
    assert float(versions[1].tags["linear.top1"]) == linear["top1"]
    linked = {m.key: m.value for m in client.get_logged_model(rec["model_id"]).metrics}
    assert linked["top1.linear"] == linear["top1"]
    assert linked["top1.knn"] == json.loads((dst / "metrics/knn.json").read_text())["top1"]

    out = tmp_path / "champion.pt"
    proc = subprocess.run([sys.executable, "-c", LOAD_CHAMPION, str(out)], cwd=dst,
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    fs = load_features(dst / "features/test.pt")
    rows = fs.features[[fs.keys.index(k) for k in got["keys"]]]
    # width 8: layer3 has 4 x 8 = 32 channels; its whole 4 x 4 map at 28 px
    assert got["features"].shape == rows.shape == (10, 32 * 4 * 4)
    assert torch.equal(got["features"], rows)  # bit for bit
    # the report links the experiment's runs table
    assert "workflowType=machine_learning" in (dst / "reports/report.html").read_text()


def _idx(path: Path) -> np.ndarray:
    """An idx file read as the format defines it: magic (ndim in the low byte), dims, bytes."""
    with gzip.open(path) as f:
        ndim = struct.unpack(">I", f.read(4))[0] & 0xFF
        dims = struct.unpack(f">{ndim}I", f.read(4 * ndim))
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(dims)


def _knn_top1(bank: np.ndarray, bank_y: np.ndarray, queries: np.ndarray, query_y: np.ndarray,
              k: int = 200, T: float = 0.1) -> float:
    """Slow reference of the weighted kNN (InstDisc): cosine, k nearest, votes exp(sim / T)."""
    bank = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    correct = 0
    for row, y in zip(queries, query_y):
        sims = bank @ row
        top = np.argsort(-sims, kind="stable")[:k]
        votes = np.bincount(bank_y[top], weights=np.exp(sims[top] / T), minlength=10)
        correct += int(np.argmax(votes) == y)  # ties: the lowest label, as knn_classify
    return 100.0 * correct / len(query_y)


def test_pipeline__knn_numbers_equal_a_numpy_reference(repo):
    # The raw-pixel baseline and the knn stage recomputed from outside the pipeline: images and
    # labels from the original idx files, found by the sample keys (`train_000123` = image 123
    # of the train file), in float64 numpy. This checks the data path (selection, decoding,
    # normalisation, labels) and that embed kept features and labels aligned.
    dst, _, _ = repo
    raw = {"train": (_idx(FMNIST), _idx(FMNIST.with_name("train-labels-idx1-ubyte.gz"))),
           "test": (_idx(FMNIST.with_name("t10k-images-idx3-ubyte.gz")),
                    _idx(FMNIST.with_name("t10k-labels-idx1-ubyte.gz")))}
    pixels, labels, feats = {}, {}, {}
    for split in ("train", "test"):
        saved = torch.load(dst / f"features/{split}.pt", weights_only=True)
        assert all(k.startswith(f"{split}_") for k in saved["keys"])
        rows = [int(k.split("_")[1]) for k in saved["keys"]]
        assert len(set(rows)) == len(rows)
        images, y = raw[split][0][rows], raw[split][1][rows].astype(np.int64)
        # the cosine is scale-invariant: (x / 255 - mean) / std ~ x / 255 - mean (mean 0.286)
        pixels[split] = images.reshape(len(rows), -1) / 255.0 - 0.286
        labels[split], feats[split] = y, saved["features"].double().numpy()
        assert np.array_equal(saved["labels"].numpy(), y)
    assert np.bincount(labels["test"]).tolist() == [50] * 10  # stratified: chance is 10 %
    assert np.bincount(labels["train"]).tolist() == [200] * 10
    baselines = json.loads((dst / "eval/metrics/baselines.json").read_text())
    knn = json.loads((dst / "eval/metrics/knn.json").read_text())
    # float32 (the stages) vs float64 (here): a near-tie may flip at most 2 of the 500 queries
    ref_pixels = _knn_top1(pixels["train"], labels["train"], pixels["test"], labels["test"])
    assert baselines["raw_pixels_top1"] == pytest.approx(ref_pixels, abs=0.41)
    ref_knn = _knn_top1(feats["train"], labels["train"], feats["test"], labels["test"])
    assert (knn["k"], knn["T"]) == (200, 0.1)
    assert knn["top1"] == pytest.approx(ref_knn, abs=0.41)


def test_pipeline__second_repro_is_noop(repo):
    dst, env, _ = repo
    out = text_of(sh(["dvc", "repro"], dst, env))
    assert ran(out) == [INDEX]
    status = text_of(sh(["dvc", "status"], dst, env))
    assert status.split() == [f"{INDEX}:", "always", "changed"], status


def test_pipeline__knn_param_reruns_only_knn_and_report(repo):
    dst, env, _ = repo
    out = text_of(sh(["dvc", "exp", "run", "-S", "knn.k=20"], dst, env))
    assert ran(out) == ["check_params", INDEX, "knn", "report"]  # both outputs content-stable
    assert json.loads((dst / "eval/metrics/knn.json").read_text())["k"] == 20


def test_pipeline__pretrain_param_reruns_pretrain_and_after(repo):
    dst, env, _ = repo
    out = text_of(sh(["dvc", "exp", "run", "-S", "pretrain.lr=0.05"], dst, env))
    assert ran(out) == ["check_params", INDEX, "pretrain", "data_insights", "embed", "knn",
                        "linear", "label_efficiency", "select_labels", "report"]


def test_pipeline__second_pretraining__new_version_champion_moves_only_if_higher(repo):
    dst, env, _ = repo  # after the pretrain.lr experiment above
    _, versions, aliases = registry(env)
    first = json.loads(sh(["git", "show", "HEAD:metrics/linear.json"], dst, env).stdout)["top1"]
    second = json.loads((dst / "metrics/linear.json").read_text())["top1"]
    assert sorted(versions) == [1, 2] and aliases["newest"] == 2
    assert versions[1].tags["dvc.exp_name"] == "workspace"  # dvc repro
    assert versions[2].tags["dvc.exp_name"] not in ("", "workspace")  # dvc exp run's name
    assert [float(versions[v].tags["linear.top1"]) for v in (1, 2)] == [first, second]
    assert versions[1].tags["params.digest"] != versions[2].tags["params.digest"]  # lr differs
    assert aliases["champion"] == (2 if second > first else 1)


def test_pipeline__mlflow_has_finished_runs_per_stage(repo):
    dst, env, _ = repo
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("moco-pipeline")
    runs = client.search_runs([exp.experiment_id], max_results=500)
    by_stage: dict[str, list[str]] = {}
    for r in runs:
        by_stage.setdefault(r.data.tags["stage"], []).append(r.info.status)
    assert set(by_stage) == set(STAGES) - {"check_data", "check_eval"}  # validations log no run
    assert all(s == "FINISHED" for statuses in by_stage.values() for s in statuses)
    report = [r for r in runs if r.data.tags["stage"] == "report"]
    assert all("knn.top1" in r.data.metrics and "moco.K" in r.data.params for r in report)
    # the headline numbers, one row per pipeline run; the run named after its DVC experiment
    knn = json.loads((dst / "metrics/knn.json").read_text())["top1"]  # the last experiment's
    assert all({"top1.knn", "top1.linear", "top1.knn.pixels"} <= set(r.data.metrics)
               for r in report)
    assert knn in {r.data.metrics["top1.knn"] for r in report}
    first = min(report, key=lambda r: r.info.start_time)
    assert first.info.run_name == "workspace:report"
    assert {r.info.run_name for r in report} - {"workspace:report"}  # dvc exp run's names
    pretrain = min((r for r in runs if r.data.tags["stage"] == "pretrain"),
                   key=lambda r: r.info.start_time)
    assert {a.path for a in client.list_artifacts(pretrain.info.run_id, "curves")} == {
        "curves/knn_monitor.tsv", "curves/knn_monitor.png", "curves/labelfree.tsv",
        "curves/labelfree.png"}
    # lineage: the report run names the runs of every upstream stage
    assert all(r.data.tags.get("upstream.pretrain", "unknown") != "unknown" for r in report)


def test_pipeline__outputs_rewritten__run_not_dirty_params_edit_dirty(repo):
    # last: it moves the `newest` alias. The pretrain.lr experiment above left its params.yaml in
    # the workspace (dirty: a params edit); with the committed params back, a forced pretrain
    # (it resumes the finished checkpoint and re-exports) rewrites only the pipeline's outputs
    dst, env, _ = repo
    _, versions, _ = registry(env)
    assert versions[max(versions)].tags["git.dirty"] == "true"  # pretrain.lr=0.05 vs HEAD
    assert versions[1].tags["git.dirty"] == "false"  # the first `dvc repro`, committed tree
    sh(["git", "checkout", "--", "params.yaml"], dst, env)
    sh(["dvc", "repro", "-f", "-s", "pretrain"], dst, env)
    changed = sh(["git", "status", "--porcelain", "--untracked-files=no"], dst, env).stdout.split()
    assert "metrics/pretrain.json" in changed and "params.yaml" not in changed
    # the same weights as the first `dvc repro`'s: no new version; `newest` is version 1 again
    _, after, aliases = registry(env)
    assert sorted(after) == sorted(versions) and aliases["newest"] == 1
    rec = json.loads((dst / "runs/pretrain.json").read_text())
    assert rec["model_version"] == "1"
    from mlflow.tracking import MlflowClient

    run = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(rec["run_id"])
    assert run.data.tags["git.dirty"] == "false", changed
