"""A stage refuses, at its end, params and code that changed while it ran (treeverse/dvc#11058).

DVC records a stage's params and deps in ``dvc.lock`` and its run cache when the stage ENDS: an
edit made while it runs is recorded against outputs computed from the old values, and the run
cache later restores those outputs for the new values. Each stage ends with one ``error:
InputsChanged`` line instead (:mod:`pipeline.stage_inputs`, called by the stage entry).

The DVC case runs a real ``dvc repro`` of a one-stage pipeline whose stage is
:func:`pipeline.cli.stage_entry` around a body that waits for the test: ``pretrain.lr`` is
edited from 0.06 to 0.03 while it waits. The other cases call the stage entry in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import says

from pipeline.cli import stage_main

REPO = Path(__file__).resolve().parents[1]
CI = yaml.safe_load((REPO / "configs/ci.yaml").read_text())  # pretrain.lr 0.06, knn.k 200

# the stage waits for the test between reading its params and writing its output
TOY = """
import json, os, sys, time
from pathlib import Path

from pipeline.cli import stage_entry


def run(p):
    sync = Path(os.environ["TOY_SYNC"])
    (sync / "started").touch()
    deadline = time.monotonic() + 120
    while not (sync / "go").exists():
        assert time.monotonic() < deadline, "the test never said go"
        time.sleep(0.02)
    Path("out.json").write_text(json.dumps({"lr": p.pretrain.lr}))


if __name__ == "__main__":
    stage_entry("toy", run)
"""

DVC_YAML = {"stages": {"toy": {"cmd": "python stages/toy.py", "deps": ["stages/toy.py", "pkg"],
                               "params": ["seed", "pretrain"], "outs": ["out.json"]}}}


def _write_params(path: Path, **edits: float) -> None:
    """configs/ci.yaml with ``section.key=value`` edits (``pretrain__lr=0.03``)."""
    tree = yaml.safe_load(yaml.safe_dump(CI))
    for dotted, value in edits.items():
        section, key = dotted.split("__")
        tree[section][key] = value
    path.write_text(yaml.safe_dump(tree, sort_keys=False))


@pytest.fixture
def toy_repo(tmp_path) -> Path:
    """A folder holding ``dvc.yaml`` (stage ``toy``), ``params.yaml``, its script, a package."""
    repo = tmp_path / "repo"
    (repo / "stages").mkdir(parents=True)
    (repo / "stages/toy.py").write_text(TOY)
    (repo / "pkg").mkdir()
    (repo / "pkg/__init__.py").write_text("")
    (repo / "pkg/mod.py").write_text("X = 1\n")
    (repo / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    _write_params(repo / "params.yaml")
    return repo


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


@pytest.mark.slow
def test_dvc_repro__lr_edited_while_the_stage_runs__refused_nothing_recorded(toy_repo, tmp_path):
    sync = tmp_path / "sync"
    sync.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "MLFLOW_"))}
    env.update({"PYTHONPATH": str(REPO), "TOY_SYNC": str(sync), "DVC_NO_ANALYTICS": "1",
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    subprocess.run(["dvc", "init", "-q", "--no-scm"], cwd=toy_repo, env=env, check=True)
    proc = subprocess.Popen(["dvc", "repro", "toy"], cwd=toy_repo, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (sync / "started").exists():  # the stage has read params.yaml
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    _write_params(toy_repo / "params.yaml", pretrain__lr=0.03)
    (sync / "go").touch()
    stdout, stderr = proc.communicate(timeout=120)

    assert proc.returncode != 0, stdout + stderr
    (line,) = _error_lines(stderr)  # DVC's own "ERROR: failed to reproduce" is upper case
    says(line, "error: InputsChanged: toy:", "params.yaml 'pretrain.lr' (0.06 -> 0.03)",
         "dvc#11058", "rerun `dvc repro`")
    assert line.count("'") == 2  # the one key that changed, no other leaf of `pretrain`
    lock = toy_repo / "dvc.lock"
    assert not lock.exists() or "toy" not in (yaml.safe_load(lock.read_text()) or {}).get(
        "stages", {})
    runs = toy_repo / ".dvc/cache/runs"
    assert not runs.exists() or not [f for f in runs.rglob("*") if f.is_file()]

    # run again on the file as it is now: it runs and records what it read
    again = subprocess.run(["dvc", "repro", "toy"], cwd=toy_repo, env=env, text=True,
                           capture_output=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert yaml.safe_load((toy_repo / "out.json").read_text()) == {"lr": 0.03}
    recorded = yaml.safe_load(lock.read_text())["stages"]["toy"]["params"]["params.yaml"]
    assert recorded["pretrain"]["lr"] == 0.03
    assert len([f for f in runs.rglob("*") if f.is_file()]) == 1


def _stage(repo: Path, monkeypatch, edit) -> int:
    """``toy``'s stage entry in-process in ``repo``; ``edit()`` runs inside the stage body."""
    monkeypatch.chdir(repo)
    return stage_main("toy", lambda p: edit(), ["--params", "params.yaml"])


def test_stage_main__declared_param_and_code_edited__one_line_naming_both(toy_repo, monkeypatch,
                                                                          capsys):
    def edit() -> None:
        _write_params(toy_repo / "params.yaml", pretrain__lr=0.03, knn__k=5)
        (toy_repo / "pkg/mod.py").write_text("X = 2\n")

    assert _stage(toy_repo, monkeypatch, edit) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    says(line, "InputsChanged", "params.yaml 'pretrain.lr' (0.06 -> 0.03)", "pkg/mod.py")
    assert "knn.k" not in line  # not a param of the stage: DVC records no knn.k for it


def test_stage_main__undeclared_param_comment_or_pycache__no_refusal(toy_repo, monkeypatch,
                                                                     capsys):
    def edit() -> None:
        text = (toy_repo / "params.yaml").read_text()
        # another stage's param, a comment (DVC compares values), a same-value respelling
        _write_params(toy_repo / "params.yaml", knn__k=5)
        (toy_repo / "params.yaml").write_text(
            "# a comment\n" + (toy_repo / "params.yaml").read_text().replace(
                "lr: 0.06", "lr: 6.0e-2"))
        assert text != (toy_repo / "params.yaml").read_text()
        (toy_repo / "pkg/__pycache__").mkdir()
        (toy_repo / "pkg/__pycache__/mod.cpython-311.pyc").write_bytes(b"\0")

    assert _stage(toy_repo, monkeypatch, edit) == 0
    assert _error_lines(capsys.readouterr().err) == []


def test_stage_main__stage_not_in_dvc_yaml__params_not_compared(toy_repo, monkeypatch, capsys):
    (toy_repo / "dvc.yaml").write_text("stages: {}\n")  # run by hand: nothing records its params
    assert _stage(toy_repo, monkeypatch,
                  lambda: _write_params(toy_repo / "params.yaml", pretrain__lr=0.03)) == 0
    assert _error_lines(capsys.readouterr().err) == []


def test_check_params__params_yaml_edited_while_checking__refused(toy_repo, monkeypatch, capsys):
    # check_params has params.yaml itself as a dep (no params): its bytes are compared. The edit
    # comes as the stage writes its stamp (pipeline.atomic.write_json, imported inside main).
    from test_config import check_params_stage

    import pipeline.atomic

    (toy_repo / "dvc.yaml").write_text(yaml.safe_dump(
        {"stages": {"check_params": {"cmd": "python stages/check_params.py",
                                     "deps": ["params.yaml"]}}}))
    write_json = pipeline.atomic.write_json

    def write_and_edit(path, obj) -> None:
        write_json(path, obj)
        _write_params(toy_repo / "params.yaml", knn__k=5)

    monkeypatch.setattr(pipeline.atomic, "write_json", write_and_edit)
    monkeypatch.chdir(toy_repo)
    assert check_params_stage([]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    says(line, "error: InputsChanged: check_params:", "params.yaml", "dvc#11058")


def test_stage_main__edit_while_tracked__run_failed_nothing_registered(toy_repo, db, monkeypatch,
                                                                       capsys):
    # the helper's new-user check: an lr edited during pretrain was refused by DVC, but the
    # stage had already registered a model version, moved the alias `newest` and ended its
    # MLflow run FINISHED. Now the registry calls and the run's end check the inputs first.
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import registry, stage_run

    registered: list[str] = []
    monkeypatch.setattr(registry, "_log_and_register", lambda *a, **k: registered.append("v"))

    def body(p) -> None:
        with stage_run("toy", p) as run:
            _write_params(toy_repo / "params.yaml", pretrain__lr=0.03)
            registry.publish_encoder(run, params=p, training=None, encoder_path=Path("x.pt"),
                                     example_split=Path("shards/test"))

    monkeypatch.chdir(toy_repo)
    assert stage_main("toy", body, ["--params", "params.yaml"]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    says(line, "InputsChanged", "params.yaml 'pretrain.lr' (0.06 -> 0.03)")
    assert registered == []
    client = MlflowClient(db)
    (run,) = client.search_runs([client.get_experiment_by_name("moco-pipeline").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["failed.reason"].startswith("InputsChanged: toy:")
    assert not (toy_repo / "runs/toy.json").exists()


def test_stage_main__edit_after_the_tracked_block__run_failed(toy_repo, db, monkeypatch, capsys):
    # the edit lands in the run's last moments (after the stage's own registry calls): the
    # run's end checks too, and the run is FAILED, not FINISHED
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import stage_run

    def body(p) -> None:
        with stage_run("toy", p):
            _write_params(toy_repo / "params.yaml", pretrain__lr=0.03)

    monkeypatch.chdir(toy_repo)
    assert stage_main("toy", body, ["--params", "params.yaml"]) == 1
    client = MlflowClient(db)
    (run,) = client.search_runs([client.get_experiment_by_name("moco-pipeline").experiment_id])
    assert run.info.status == "FAILED"
