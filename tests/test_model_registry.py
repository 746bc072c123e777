"""The encoder as an MLflow model (#30): logged model, registry version, scores, aliases.

An encoder from the real pretraining and export code (tiny: width 4) is published by the same
functions the stages call, inside real ``stage_run`` runs on a throwaway SQLite database
(tests/registryhelpers.py).
"""

import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
import torchvision
import yaml
from mlflow.tracking import MlflowClient
from registryhelpers import PARAMS, other_bytes, publish, score, train_tiny, training_of

from pipeline.config import from_dict
from pipeline.evaluate.run.embed import load_encoder
from pipeline.tracking import StageRun, stage_run
from pipeline.tracking.model import pickled_globals, plain_encoder
from pipeline.tracking.registry import (
    CHAMPION,
    NEWEST,
    choose_champion,
    link_encoder_input,
    publish_encoder,
    trusted_encoder,
)
from pipeline.train.training_input import params_digest

NAME = "moco-encoder"


def test_choose_champion__best_wins_current_keeps_a_tie():
    assert choose_champion({1: 80.0}, None) == 1
    assert choose_champion({1: 80.0, 2: 75.0}, 1) == 1  # lower: stays
    assert choose_champion({1: 80.0, 2: 80.0}, 1) == 1  # equal: stays
    assert choose_champion({1: 80.0, 2: 80.5}, 1) == 2  # higher: moves
    assert choose_champion({1: 70.0, 2: 90.0, 3: 90.0}, 1) == 2  # tie elsewhere: the oldest
    with pytest.raises(ValueError):
        choose_champion({}, None)


def test_params_digest__training_params_only():
    base = from_dict({})
    d = params_digest(base)
    assert len(d) == 64 and int(d, 16) >= 0
    assert params_digest(from_dict({"knn": {"k": 7}, "mlflow": {"experiment": "x"}})) == d
    assert params_digest(from_dict({"pretrain": {"lr": 0.5}})) != d
    assert params_digest(from_dict({"seed": 1})) != d


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A folder with ``data/shards`` and ``models/encoder.{pt,json,safetensors}``."""
    return train_tiny(tmp_path_factory.mktemp("trained"))


@pytest.fixture()
def wd(tmp_path, trained, monkeypatch):
    """A stage working directory (copy of ``trained``) logging to its own SQLite database."""
    wd = tmp_path / "wd"
    shutil.copytree(trained, wd)
    monkeypatch.chdir(wd)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{wd / 'mlflow.db'}")
    monkeypatch.setenv("DVC_EXP_NAME", "exp-a")
    yield wd
    mlflow.set_tracking_uri(None)


# A plain venv: torch, torchvision and mlflow, not this project (its editable install is
# blocked: importing pipeline.* fails). Loads the model; .eval(), .train(), .to(), an SGD step.
LOAD_PLAIN = """
import importlib.abc, json, os, sys


class NoProject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "pipeline" or name.startswith("pipeline."):
            raise ImportError(f"{name}: the project is not installed here")


sys.meta_path.insert(0, NoProject())
import mlflow, torch

model = mlflow.pytorch.load_model(sys.argv[1])
x = torch.load(sys.argv[2])
model.eval()
with torch.no_grad():
    torch.save(model(x), sys.argv[3])
model.train()
training = model.training and all(m.training for m in model.modules())
model.to("cpu")
before = [p.detach().clone() for p in model.parameters()]
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(x).pow(2).mean()
loss.backward()
opt.step()
changed = sum(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
print(json.dumps({"type": f"{type(model).__module__}.{type(model).__name__}",
                  "training": training, "params": len(before), "changed": changed,
                  "project": sorted(m for m in sys.modules if m.split(".")[0] == "pipeline"),
                  "cwd": os.getcwd(), "pythonpath": os.environ.get("PYTHONPATH")}))
"""


def _test_images(n: int) -> torch.Tensor:
    """``(n, 1, 16, 16)``: the first test images after the evaluation transform."""
    from pipeline.data.eval_loader import eval_loader
    from pipeline.data.loader import read_manifest
    from pipeline.data.views import build_eval_transform

    m = read_manifest("data/shards/test")
    x, _, _ = next(iter(eval_loader("data/shards/test", batch_size=n, max_images=n,
                                    transform=build_eval_transform(16, m.mean, m.std))))
    return x


def test_publish_encoder__logged_model_version_tags_alias(wd):
    rec = publish()
    c = MlflowClient()
    assert rec["registered_model"] == NAME and rec["model_version"] == "1"
    model = c.get_logged_model(rec["model_id"])
    assert model.source_run_id == rec["run_id"] and model.name == "encoder"
    assert model.params["encoder.width"] == "4"
    v = c.get_model_version_by_alias(NAME, NEWEST)
    assert str(v.version) == "1" and v.run_id == rec["run_id"]
    assert v.tags["dvc.exp_name"] == "exp-a"
    assert v.tags["params.digest"] == params_digest(from_dict(PARAMS))
    assert v.tags["training.fingerprint"] == training_of(from_dict(PARAMS)).fingerprint
    assert v.tags["encoder.md5"] == hashlib.md5(Path("models/encoder.pt").read_bytes()).hexdigest()
    assert "git.commit" in v.tags and "experiment_id" not in v.tags  # the source run has it
    run = c.get_run(rec["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["registry.version"] == f"{NAME}/1"
    # encoder.json travels with the model
    local = mlflow.artifacts.download_artifacts(f"models:/{rec['model_id']}")
    assert json.loads((Path(local) / "extra_files/encoder.json").read_text()) == json.loads(
        Path("models/encoder.json").read_text())
    mlmodel = yaml.safe_load((Path(local) / "MLmodel").read_text())
    assert mlmodel["flavors"]["pytorch"]["model_data"] == "data"
    assert (Path(local) / "data/model.pth").is_file()  # the pickle format, not model.pt2
    assert (Path(local) / "data/pickle_module_info.txt").read_text() == "pickle"
    reqs = (Path(local) / "requirements.txt").read_text().split()
    assert reqs == [f"mlflow=={mlflow.__version__}", f"torch=={torch.__version__.split('+')[0]}",
                    f"torchvision=={torchvision.__version__.split('+')[0]}"]


def test_registered_model__plain_module_in_a_fresh_process_without_the_project(wd, tmp_path):
    publish()
    x = _test_images(10)
    torch.save(x, tmp_path / "x.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "MLFLOW_ALLOW_PICKLE_DESERIALIZATION")}
    out = subprocess.run([sys.executable, "-c", LOAD_PLAIN, f"models:/{NAME}@{NEWEST}",
                          str(tmp_path / "x.pt"), str(tmp_path / "y.pt")], cwd=elsewhere,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    eager, meta = load_encoder(Path("models/encoder.pt"), pool_grid=1)
    n_params = len(list(eager.parameters()))
    assert got == {"type": "torchvision.models.resnet.ResNet", "training": True,
                   "params": n_params, "changed": n_params, "project": [],
                   "cwd": str(elsewhere), "pythonpath": None}
    with torch.no_grad():
        want = eager.eval()(x)
    features = torch.load(tmp_path / "y.pt")
    assert features.shape == (10, meta["num_features"]) == (10, 32)  # width 4: 8 * 4 features
    assert torch.equal(features, want)  # the same operations on the same weights: bit for bit


def test_registered_model__graph_extra_file_gives_the_same_features_any_batch(wd, monkeypatch):
    rec = publish()
    # what the graph is for: a host that loads no pickle refuses the model itself
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false")
    with pytest.raises(mlflow.exceptions.MlflowException, match="pickle is disallowed"):
        mlflow.pytorch.load_model(f"models:/{NAME}@{NEWEST}")
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{rec['model_id']}"))
    # MLflow's own check that loading a pt2 archive unpickles nothing (it raises otherwise)
    mlflow.pytorch._validate_pt2_archive_is_pickle_free(str(local / "extra_files/encoder.pt2"))
    graph = torch.export.load(str(local / "extra_files/encoder.pt2")).module()
    eager, _ = load_encoder(Path("models/encoder.pt"), pool_grid=1)
    x = _test_images(10)
    with torch.no_grad():
        assert torch.equal(graph(x), eager.eval()(x))
        # the batch size is free, 1 included (compared at equal batch size: the convolution's
        # kernel choice, and so the last bits, depend on it in eager mode too)
        assert torch.equal(graph(x[:1]), eager(x[:1]))


@pytest.mark.parametrize("layer, grid", [(4, 1), (3, 2)])
def test_plain_encoder__torch_classes_only_same_features(trained, layer, grid):
    from torch import nn

    raw, _ = load_encoder(trained / "models/encoder.pt", pool_grid=grid, layer=layer)
    assert "pipeline.moco.backbones.WideResNet" in pickled_globals(raw)
    if grid > 1:
        assert "pipeline.evaluate.pooling.GridPool" in pickled_globals(raw)
    x = torch.randn(6, 1, 16, 16)
    with torch.no_grad():
        want = raw.eval()(x)
        plain = plain_encoder(raw)
        got = plain.eval()(x)
    names = pickled_globals(plain)
    assert not [n for n in names if n.startswith("pipeline.")], names
    assert "torchvision.models.resnet.ResNet" in names
    assert type(plain.avgpool) is nn.AdaptiveAvgPool2d and plain.avgpool.output_size == (grid, grid)
    # 16 px, stride-2 stem: layer 4 is 1 x 1 (8 * 4 channels), layer 3 is 2 x 2 (4 * 4 channels)
    assert got.shape == (6, 32 if layer == 4 else 16 * grid * grid)
    assert torch.equal(got, want)


class Doubled(torchvision.models.ResNet):
    """A ResNet with its own forward: loading it needs this file."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_plain_encoder__own_forward__refused_by_name():
    from torchvision.models.resnet import BasicBlock

    with pytest.raises(TypeError, match=r"need test_model_registry\.Doubled to be unpickled;"):
        plain_encoder(Doubled(BasicBlock, [1, 1, 1, 1]))


def test_scores_and_champion__moves_only_when_higher(wd):
    c = MlflowClient()
    first = publish()
    score("knn", 61.0)
    assert score("linear", 80.0) == 1
    model = c.get_logged_model(first["model_id"])
    linked = {m.key: (m.value, m.dataset_name) for m in model.metrics if "." in m.key}
    # the headline names, as in the runs table; only them (the stages' other numbers stay in
    # their runs)
    assert linked == {"top1.knn": (61.0, "synthetic/test"),
                      "top1.linear": (80.0, "synthetic/test")}
    knn_run = c.get_run(json.loads(Path("runs/knn.json").read_text())["run_id"])
    assert [i.model_id for i in knn_run.inputs.model_inputs] == [first["model_id"]]

    other_bytes()
    second = publish()
    assert second["model_version"] == "2"
    assert int(c.get_model_version_by_alias(NAME, NEWEST).version) == 2
    assert score("linear", 75.0) == 1  # lower: the champion stays
    assert int(c.get_model_version_by_alias(NAME, CHAMPION).version) == 1
    assert c.get_model_version("moco-encoder", "2").tags["linear.top1"] == "75"
    other_bytes()
    third = publish()
    assert score("linear", 80.5) == 3  # higher: it moves
    assert int(c.get_model_version_by_alias(NAME, CHAMPION).version) == 3
    assert third["model_version"] == "3"


def test_attach_scores__stale_tags_of_the_stage_removed_others_kept(wd):
    publish()
    c = MlflowClient()
    # an earlier evaluation that chose k on a validation split left these (older code tagged
    # every top-1/top-5 of the stage)
    for k, v in {"knn.top1": "88", "knn.top5": "99.5", "knn.select_val_top1": "88.5",
                 "knn.protocol_top1": "81"}.items():
        c.set_model_version_tag(NAME, "1", k, v)
    score("linear", 80.0)
    score("knn", 61.0)  # this one: fixed k and T, no validation score
    tags = c.get_model_version(NAME, "1").tags
    assert {k: v for k, v in tags.items() if k.startswith("knn.")} == {"knn.top1": "61"}
    assert tags["linear.top1"] == "80"  # another stage's score stays
    # the version page's tags: where it comes from, what it is, its scores
    assert sorted(tags) == ["dvc.exp_name", "encoder.md5", "git.commit", "git.dirty",
                            "knn.top1", "linear.top1", "params.digest", "training.fingerprint"]


def test_link_encoder_input__embed_run_lists_the_model(wd):
    rec = publish()
    p = from_dict(PARAMS)
    with stage_run("embed", p) as r:
        link_encoder_input(r, trusted_encoder(r, params=p, encoder_path=Path("models/encoder.pt"),
                                              example_split=Path("data/shards/test")))
    run = MlflowClient().get_run(json.loads(Path("runs/embed.json").read_text())["run_id"])
    assert [i.model_id for i in run.inputs.model_inputs] == [rec["model_id"]]


def test_publish_encoder__registry_failure__one_warning_run_finished(wd, monkeypatch, caplog):
    def refuse(*a, **k):
        raise mlflow.exceptions.MlflowException("registry is read-only")

    monkeypatch.setattr(mlflow, "register_model", refuse)
    rec = publish()
    warnings = [r for r in caplog.records if r.levelname == "WARNING"
                and r.name == "pipeline.tracking.registry"]
    assert [w.getMessage() for w in warnings] == [
        f"could not register model '{NAME}' in the MLflow registry: MlflowException: registry "
        "is read-only; the stage's outputs are kept"]
    assert rec["model_id"].startswith("m-") and "model_version" not in rec
    run = MlflowClient().get_run(rec["run_id"])
    assert run.info.status == "FINISHED" and "read-only" in run.data.tags["registry.error"]
    assert score("linear", 80.0) is None  # no version to rank: nothing moves, no error


def test_publish_encoder__logging_failure__no_model_stage_goes_on(wd, monkeypatch):
    def broken(*a, **k):
        raise OSError("artifact store is full")

    monkeypatch.setattr(mlflow.pytorch, "log_model", broken)
    rec = publish()
    assert "model_id" not in rec
    run = MlflowClient().get_run(rec["run_id"])
    assert run.info.status == "FINISHED" and "is full" in run.data.tags["model.error"]


def test_publish_encoder__empty_name__logged_not_registered(wd):
    rec = publish(from_dict({**PARAMS, "mlflow": {"registered_model": ""}}))
    assert rec["model_id"].startswith("m-") and "registered_model" not in rec
    assert MlflowClient().search_registered_models() == []


def test_publish_encoder__inactive_run__no_op(wd):
    run = StageRun(None)
    publish_encoder(run, params=from_dict(PARAMS), training=training_of(from_dict(PARAMS)),
                    encoder_path=Path("models/encoder.pt"),
                    example_split=Path("data/shards/test"))
    assert run.record == {} and not Path("mlflow.db").exists()


# --- a version is trusted by its encoder.md5; champion over all versions; one-line warnings ---


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def _other_encoder() -> bytes:
    """``models/encoder.pt`` with other weights, same architecture: another encoder and md5."""
    sd = torch.load("models/encoder.pt", weights_only=True)
    sd["conv1.weight"] = sd["conv1.weight"] + 1.0
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("pipeline")]


def test_trusted_encoder__database_replaced__registers_again_in_one_line(wd, monkeypatch,
                                                                          caplog):
    mine = Path("models/encoder.pt").read_bytes()
    publish()  # version 1 of mlflow.db; runs/pretrain.json names it
    record = Path("runs/pretrain.json").read_text()
    # mlflow.db deleted: a new database, in which another training registered version 1 first
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{wd / 'new.db'}")
    other = _other_encoder()
    Path("models/encoder.pt").write_bytes(other)
    publish()
    Path("models/encoder.pt").write_bytes(mine)
    Path("runs/pretrain.json").write_text(record)  # DVC restored pretrain from its run cache
    caplog.clear()
    assert score("knn", 70.0) is None
    assert _warnings(caplog) == [
        f"models/encoder.pt (md5 {_md5(mine)}) has no version in '{NAME}'; runs/pretrain.json "
        f"names version 1, whose encoder.md5 is {_md5(other)}: registered it again as "
        f"version 2 of '{NAME}'"]
    c = MlflowClient()
    v1, v2 = c.get_model_version(NAME, "1"), c.get_model_version(NAME, "2")
    assert v2.tags["encoder.md5"] == _md5(mine) and v2.tags["knn.top1"] == "70"
    assert v1.tags["encoder.md5"] == _md5(other) and "knn.top1" not in v1.tags
    caplog.clear()
    assert score("linear", 80.0) == 2  # found by its md5: no new version, no warning
    assert _warnings(caplog) == []
    assert sorted(int(v.version) for v in c.search_model_versions(f"name = '{NAME}'")) == [1, 2]
    assert c.get_model_version(NAME, "2").tags["linear.top1"] == "80"
    assert "linear.top1" not in c.get_model_version(NAME, "1").tags


def test_trusted_encoder__recorded_version_missing__registered_again(wd, monkeypatch, caplog):
    publish()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{wd / 'empty.db'}")
    caplog.clear()
    assert score("linear", 80.0) == 1
    md5 = _md5(Path("models/encoder.pt").read_bytes())
    assert _warnings(caplog) == [
        f"models/encoder.pt (md5 {md5}) has no version in '{NAME}'; runs/pretrain.json names "
        f"version 1, which this database does not have: registered it again as version 1 of "
        f"'{NAME}'"]
    v = MlflowClient().get_model_version_by_alias(NAME, CHAMPION)
    assert (str(v.version), v.tags["encoder.md5"], v.tags["linear.top1"]) == ("1", md5, "80")


def test_trusted_encoder__registration_failed_at_pretrain__its_logged_model_registered(
        wd, monkeypatch, caplog):
    def refuse(*a, **k):
        raise mlflow.exceptions.MlflowException("registry is read-only")

    real = mlflow.register_model
    monkeypatch.setattr(mlflow, "register_model", refuse)
    rec = publish()  # logged, not registered (one warning)
    monkeypatch.setattr(mlflow, "register_model", real)  # the registry is back
    caplog.clear()
    assert score("linear", 80.0) == 1
    md5 = _md5(Path("models/encoder.pt").read_bytes())
    assert _warnings(caplog) == [
        f"models/encoder.pt (md5 {md5}) has no version in '{NAME}' and runs/pretrain.json "
        f"names none: registered logged model {rec['model_id']} as version 1 of '{NAME}'"]
    v = MlflowClient().get_model_version(NAME, "1")
    assert v.source == f"models:/{rec['model_id']}"  # the pretrain run's model, not a new one
    assert (v.tags["encoder.md5"], v.tags["linear.top1"]) == (md5, "80")
    assert v.tags["params.digest"] == params_digest(from_dict(PARAMS))


def test_trusted_encoder__registering_off__logged_model_by_md5(wd, monkeypatch, caplog):
    p = from_dict({**PARAMS, "mlflow": {"registered_model": ""}})
    rec = publish(p)
    caplog.clear()
    score("knn", 61.0, p)
    assert _warnings(caplog) == []
    c = MlflowClient()
    assert {m.key: m.value for m in c.get_logged_model(rec["model_id"]).metrics
            if "knn" in m.key} == {"top1.knn": 61.0}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{wd / 'empty.db'}")
    score("knn", 62.0, p)
    (line,) = _warnings(caplog)
    md5 = _md5(Path("models/encoder.pt").read_bytes())
    m = re.fullmatch(rf"models/encoder\.pt \(md5 {md5}\) has no logged model in this "
                     rf"experiment; runs/pretrain\.json names logged model {rec['model_id']}, "
                     r"which this database does not have: logged it again as model (m-\w+)",
                     line)
    assert m, line
    again = MlflowClient().get_logged_model(m.group(1))
    assert again.tags["encoder.md5"] == md5
    assert {x.key: x.value for x in again.metrics if "knn" in x.key} == {"top1.knn": 62.0}


def test_update_champion__registry_wide__two_clones_share_one_database(wd, tmp_path,
                                                                       monkeypatch):
    # two clones, one tracking server (here one SQLite file): each logs to its own experiment
    first = publish()
    assert score("linear", 33.0) == 1
    clone = tmp_path / "clone"
    shutil.copytree(wd, clone, ignore=shutil.ignore_patterns("mlflow.db*", "mlartifacts"))
    monkeypatch.chdir(clone)
    Path("models/encoder.pt").write_bytes(_other_encoder())
    second = publish()
    assert second["experiment_id"] != first["experiment_id"]
    assert second["model_version"] == "2"
    assert score("linear", 28.0) == 1  # worse than the other clone's version: it stays
    c = MlflowClient()
    assert str(c.get_model_version_by_alias(NAME, CHAMPION).version) == "1"
    other_bytes()  # a third version
    publish()
    assert score("linear", 35.0) == 3  # better than every version: it moves
    assert str(c.get_model_version_by_alias(NAME, CHAMPION).version) == "3"
    assert {str(v.version): v.tags["linear.top1"] for v in c.search_model_versions(
        f"name = '{NAME}'")} == {"1": "33", "2": "28", "3": "35"}


def test_attach_scores__database_refuses__one_line_no_sql(wd, caplog):
    import sqlite3

    rec = publish()
    con = sqlite3.connect(wd / "mlflow.db")
    con.execute("CREATE TRIGGER frozen BEFORE INSERT ON model_version_tags "
                "BEGIN SELECT RAISE(ABORT, 'model version tags are frozen'); END")
    con.commit()
    con.close()
    caplog.clear()
    assert score("knn", 70.0) is None
    assert _warnings(caplog) == [
        f"could not attach knn metrics to logged model {rec['model_id']}: MlflowException: "
        "IntegrityError: model version tags are frozen; the stage's outputs are kept"]
    run = MlflowClient().get_run(json.loads(Path("runs/knn.json").read_text())["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["model.error"] == _warnings(caplog)[0].removesuffix(
        "; the stage's outputs are kept")


def test_publish_encoder__a_bug__fails_the_stage_not_a_warning(wd, monkeypatch, caplog):
    def bug(*a, **k):
        raise TypeError("register_model() got an unexpected keyword argument")

    monkeypatch.setattr(mlflow, "register_model", bug)
    with pytest.raises(TypeError, match="unexpected keyword"):
        publish()
    assert _warnings(caplog) == []


def test_publish_encoder__same_bytes_again__no_second_version_newest_moves_back(wd):
    # A finished checkpoint exported again (a params change that trains nothing) gives the same
    # encoder bytes: version 1 again, not a version 3 without scores; `newest` points at it.
    first = publish()
    enc = Path("models/encoder.pt")
    original = enc.read_bytes()
    other_bytes()
    assert publish()["model_version"] == "2"
    enc.write_bytes(original)
    again = publish()
    c = MlflowClient()
    assert again["model_version"] == first["model_version"] == "1"
    assert len(c.search_model_versions(f"name = '{NAME}'")) == 2
    assert str(c.get_model_version_by_alias(NAME, NEWEST).version) == "1"
    assert c.get_run(again["run_id"]).data.tags["registry.version"] == f"{NAME}/1"
