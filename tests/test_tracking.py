import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipeline.config import from_dict
from pipeline.tracking import (
    TrackingError,
    error_summary,
    experiment_ui_url,
    find_experiment_id,
    git_state,
    loggable_params,
    open_experiment,
    stage_run,
    tracking_uri,
    ui_url,
)
from pipeline.tracking.provenance import pipeline_outputs, process_tags
from pipeline.tracking.runs import mark_stale_runs
from pipeline.tracking.store import check_reachable
from pipeline.tracking.ui import ensure_headline_view


def test_tracking_uri__env_then_dvc_root(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    assert tracking_uri() == "http://127.0.0.1:1"


def _yaml_leaves(tree: dict, prefix: str = "") -> dict:
    """``{"moco": {"K": 1}}`` -> ``{"moco.K": 1}``, written out here (not pipeline.config)."""
    out = {}
    for k, v in tree.items():
        out.update(_yaml_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def test_loggable_params__dotted_names_and_strings():
    # exactly the leaves of the shipped params.yaml under the names DVC gives them, each as
    # str() of its YAML value, with the one override applied: nothing added, nothing dropped
    shipped = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    want = {k: str(v) for k, v in _yaml_leaves(shipped).items()} | {"moco.K": "1024"}
    flat = loggable_params(from_dict({"moco": {"K": 1024}}))
    assert flat == want
    assert flat["pretrain.lr_milestones"] == "[120, 160]" and flat["data.source"] == "fashion_mnist"


def test_stage_run__lineage_tags_and_run_json(db, tmp_path, monkeypatch):
    monkeypatch.setenv("DVC_EXP_NAME", "exp-x")
    p = from_dict({"mlflow": {"experiment": "t"}})
    with stage_run("pretrain", p) as r:
        r.log_metrics({"loss": 1.5}, step=3)
    up = json.loads((tmp_path / "runs/pretrain.json").read_text())
    with stage_run("knn", p, upstream=("pretrain", "embed")):
        pass
    down = json.loads((tmp_path / "runs/knn.json").read_text())
    c = MlflowClient(db)
    run = c.get_run(down["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["stage"] == "knn"
    assert run.data.tags["upstream.pretrain"] == up["run_id"]
    assert run.data.tags["upstream.embed"] == "unknown"  # no runs/embed.json
    assert run.data.tags["dvc.exp_name"] == "exp-x"
    assert "git.commit" in run.data.tags and "git.dirty" in run.data.tags
    assert run.data.params["moco.K"] == "4096"
    first = c.get_run(up["run_id"])
    assert c.get_metric_history(first.info.run_id, "loss")[0].step == 3


def test_stage_run__exception_marks_failed(db, tmp_path):
    p = from_dict({})
    with pytest.raises(ZeroDivisionError), stage_run("embed", p):
        1 / 0  # noqa: B018
    runs = MlflowClient(db).search_runs([MlflowClient(db).get_experiment_by_name(
        p.mlflow.experiment).experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    assert runs[0].data.tags["failed.reason"] == "ZeroDivisionError: division by zero"
    assert not (tmp_path / "runs/embed.json").exists()


def test_stage_run__disabled_logs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # would fail if contacted
    with stage_run("knn", from_dict({"mlflow": {"enabled": False}})) as r:
        r.log_metrics({"a": 1.0})
        assert not r.active
    assert json.loads((tmp_path / "runs/knn.json").read_text())["run_id"] is None
    assert not (tmp_path / "mlflow.db").exists()


def test_check_reachable__unreachable_server_fails_fast():
    t0 = time.time()
    with pytest.raises(TrackingError, match="unreachable"):
        check_reachable("http://127.0.0.1:9", timeout_s=2)
    assert time.time() - t0 < 10


def test_stage_run__unreachable_server_before_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    entered = []
    with pytest.raises(TrackingError), stage_run("pretrain", from_dict({})):
        entered.append(1)
    assert entered == []


SCRIPT = """
import sys, time
from pipeline.config import from_dict
from pipeline.tracking import stage_run
with stage_run("pretrain", from_dict({})):
    print("started", flush=True)
    time.sleep(60)
"""


def test_stage_run__sigterm_marks_killed(db, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=os.environ.copy())
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    c = MlflowClient(db)
    runs = c.search_runs([c.get_experiment_by_name("moco-pipeline").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]


def test_stage_run__shards_logged_as_dataset_input(db, tmp_path):
    import hashlib

    from pipeline.data.build import empty_split

    split = tmp_path / "shards/pretrain"
    empty_split(split, split="pretrain", source="fashion_mnist", class_names=(), mode="L",
                build={})
    with stage_run("pretrain", from_dict({})) as r:
        r.log_shards(split, context="training")
    run = MlflowClient(db).get_run(json.loads((tmp_path / "runs/pretrain.json").read_text())
                                   ["run_id"])
    (ds,) = run.inputs.dataset_inputs
    assert ds.dataset.name == "fashion_mnist/pretrain"
    want = hashlib.sha256((split / "manifest.json").read_bytes()).hexdigest()[:36]
    assert ds.dataset.digest == want


# --- artifact location, database initialisation, stale runs, experiment kind (#15) ----------


def test_stage_run__artifacts_inside_repo_root(db, tmp_path):
    with stage_run("knn", from_dict({})):
        pass
    run_id = json.loads((tmp_path / "runs/knn.json").read_text())["run_id"]
    c = MlflowClient(db)
    run = c.get_run(run_id)
    assert run.info.artifact_uri == f"{(tmp_path / 'mlartifacts').as_uri()}/{run_id}/artifacts"
    assert (tmp_path / "mlartifacts" / run_id / "artifacts/config/params.resolved.json").is_file()
    exp = c.get_experiment(run.info.experiment_id)
    assert exp.name == "moco-pipeline"
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    tags = run.data.tags
    assert tags["repo.root"] == str(tmp_path) and tags["proc.pid"] == str(os.getpid())


def test_open_experiment__other_repo_root__own_experiment_inside_it(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    a, b = tmp_path / "a", tmp_path / "b"  # e.g. a repo and its `cp -a` copy sharing the db
    ea = open_experiment(uri, "exp", a)
    eb = open_experiment(uri, "exp", b)
    assert ea != eb and open_experiment(uri, "exp", a) == ea
    assert open_experiment(uri, "exp", b) == eb
    c = MlflowClient(uri)
    assert c.get_experiment(ea).name == "exp"
    assert c.get_experiment(eb).name == f"exp ({b})"
    assert c.get_experiment(ea).artifact_location == (a / "mlartifacts").as_uri()
    assert c.get_experiment(eb).artifact_location == (b / "mlartifacts").as_uri()


def test_open_experiment__untagged_existing__gets_kind_tag(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    eid = c.create_experiment("old", artifact_location=(tmp_path / "mlartifacts").as_uri())
    assert "mlflow.experimentKind" not in c.get_experiment(eid).tags
    assert open_experiment(uri, "old", tmp_path) == eid
    assert c.get_experiment(eid).tags["mlflow.experimentKind"] == "custom_model_development"


INIT = """
import sys
from pathlib import Path
from pipeline.tracking import open_experiment
print(open_experiment(sys.argv[1], "moco-pipeline", Path(sys.argv[2])))
"""


def test_open_experiment__three_processes_from_no_db__all_succeed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    procs = [subprocess.Popen([sys.executable, "-c", INIT, uri, str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [(p.wait(timeout=300), p.stdout.read().strip(), p.stderr.read()) for p in procs]
    assert [r[0] for r in results] == [0, 0, 0], [r[2][-2000:] for r in results]
    assert len({r[1] for r in results}) == 1  # one experiment, created once


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_mark_stale_runs__dead_owner_killed__live_or_foreign_kept(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    root = tmp_path / "repo"
    eid = open_experiment(uri, "e", root)
    c = MlflowClient(uri)
    me = process_tags()
    dead = {**me, "proc.pid": str(_dead_pid())}

    def run(stage, owner, repo=root):
        r = c.create_run(eid, tags={"stage": stage, "repo.root": str(repo), **owner})
        return r.info.run_id

    stale = run("knn", dead)
    live = run("knn", me)  # this process: alive
    other_stage = run("embed", dead)
    other_repo = run("knn", dead, repo=tmp_path / "elsewhere")
    other_host = run("knn", {**dead, "proc.host": "another-machine"})
    reused_pid = run("knn", {**me, "proc.start": "1"})  # same pid, another process start

    marked = mark_stale_runs(uri, eid, "knn", root)

    assert sorted(marked) == sorted([stale, reused_pid])
    status = {rid: c.get_run(rid).info.status for rid in
              (stale, live, other_stage, other_repo, other_host, reused_pid)}
    assert status == {stale: "KILLED", live: "RUNNING", other_stage: "RUNNING",
                      other_repo: "RUNNING", other_host: "RUNNING", reused_pid: "KILLED"}
    killed = c.get_run(stale)
    assert killed.info.end_time is not None
    assert "SIGKILL" in killed.data.tags["stale.reason"]


# --- one training = one run: resume (#30) ----------------------------------------------------


def _killed_run(p, steps=(2, 4)) -> str:
    """A pretrain run that logged ``loss`` at ``steps`` and was stopped by SIGTERM."""
    from pipeline.signals import Terminated

    with pytest.raises(Terminated), stage_run("pretrain", p) as r:
        for s in steps:
            r.log_metrics({"loss": float(s)}, step=s)
        raise Terminated("SIGTERM: checkpoint written at step 4")
    (run,) = MlflowClient().search_runs([MlflowClient().get_experiment_by_name(
        p.mlflow.experiment).experiment_id])
    assert run.info.status == "KILLED"
    return run.info.run_id


def test_stage_run__resume_killed_run__same_id_finished_steps_continue(db, tmp_path):
    p = from_dict({})
    killed = _killed_run(p)
    with stage_run("pretrain", p, resume_run_id=killed) as r:
        assert r.resumed and r.run_id == killed
        assert MlflowClient(db).get_run(killed).info.status == "RUNNING"
        for s in (6, 8):
            r.log_metrics({"loss": float(s)}, step=s)
    c = MlflowClient(db)
    (run,) = c.search_runs([run_exp(c)])
    assert run.info.run_id == killed and run.info.status == "FINISHED"
    assert [m.step for m in c.get_metric_history(killed, "loss")] == [2, 4, 6, 8]
    tags = run.data.tags
    assert "killed.reason" not in tags and tags["interrupted.count"] == "1"
    assert tags["interrupted.1"] == (f"KILLED: SIGTERM: checkpoint written at step 4; resumed "
                                     f"from the checkpoint by pid {os.getpid()} on "
                                     f"{tags['proc.host']}")
    assert json.loads((tmp_path / "runs/pretrain.json").read_text())["run_id"] == killed


def run_exp(c, name="moco-pipeline"):
    return c.get_experiment_by_name(name).experiment_id


def test_stage_run__resume_twice__interruptions_counted(db):
    from pipeline.signals import Terminated

    p = from_dict({})
    killed = _killed_run(p)
    with pytest.raises(Terminated), stage_run("pretrain", p, resume_run_id=killed):
        raise Terminated("SIGINT: checkpoint written at step 6")
    with stage_run("pretrain", p, resume_run_id=killed):
        pass
    tags = MlflowClient(db).get_run(killed).data.tags
    assert tags["interrupted.count"] == "2"
    assert tags["interrupted.2"].startswith("KILLED: SIGINT: checkpoint written at step 6;")


def test_stage_run__resume_changed_param__first_value_kept_and_named(db):
    killed = _killed_run(from_dict({}))
    p = from_dict({"pretrain": {"log_every_steps": 5}})  # not part of the fingerprint
    with stage_run("pretrain", p, resume_run_id=killed):
        pass
    run = MlflowClient(db).get_run(killed)
    assert run.data.params["pretrain.log_every_steps"] == "10"
    assert run.data.tags["resume.changed_params"] == "pretrain.log_every_steps: 10 -> 5"


@pytest.mark.parametrize("case", ["finished", "unknown", "other_stage"])
def test_stage_run__resume_id_not_continuable__new_run(db, case):
    p = from_dict({})
    if case == "finished":
        with stage_run("pretrain", p) as r:
            old = r.run_id
    elif case == "unknown":
        old = "0" * 32
    else:
        with pytest.raises(ZeroDivisionError), stage_run("knn", p) as r:
            old = r.run_id
            1 / 0  # noqa: B018 - a FAILED knn run: not this stage's
    with stage_run("pretrain", p, resume_run_id=old) as r:
        assert not r.resumed and r.run_id != old


def test_stage_run__record_fields_join_run_json(db, tmp_path):
    with stage_run("pretrain", from_dict({})) as r:
        r.record["model_id"] = "m-123"
    rec = json.loads((tmp_path / "runs/pretrain.json").read_text())
    assert rec["model_id"] == "m-123" and rec["run_id"] == r.run_id


# --- the UI entry (#30) --------------------------------------------------------------------


def test_ui_url__runs_table_of_the_model_training_view():
    table = "#/experiments/3/runs?workflowType=machine_learning"
    assert ui_url("sqlite:////x/mlflow.db", "3") == (
        f"http://127.0.0.1:5000/{table}&viewStateShareKey=headline")
    assert ui_url("https://bob:pw@mlflow.example.org:8443/", "3", view=None) == (
        f"https://mlflow.example.org:8443/{table}")
    assert ui_url("sqlite:////x/mlflow.db", None) == "http://127.0.0.1:5000/#/experiments"


def test_experiment_ui_url__this_repos_experiment__nothing_created(db, tmp_path, monkeypatch):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    missing = f"sqlite:///{tmp_path / 'none.db'}"
    assert experiment_ui_url(missing) == "http://127.0.0.1:5000/#/experiments"
    assert not (tmp_path / "none.db").exists()
    (tmp_path / "params.yaml").write_text("mlflow:\n  experiment: mine\n")
    eid = open_experiment(db, "mine", tmp_path)
    assert find_experiment_id(db, "mine", tmp_path) == eid
    table = f"http://127.0.0.1:5000/#/experiments/{eid}/runs?workflowType=machine_learning"
    # no saved view yet (an experiment written by older code): the plain table, not an error
    assert experiment_ui_url(db, tmp_path / "params.yaml") == table
    ensure_headline_view(MlflowClient(db), eid)
    assert experiment_ui_url(db, tmp_path / "params.yaml") == (
        table + "&viewStateShareKey=headline")


def test_ensure_headline_view__saved_view_tag_written_once_headline_columns(db):
    c = MlflowClient(db)
    p = from_dict({"mlflow": {"experiment": "v"}})
    with stage_run("knn", p) as r:
        eid = r.experiment_id
    tag = "mlflow.sharedViewState.headline"
    first = c.get_experiment(eid).tags[tag]
    envelope = json.loads(first)  # MLflow 3.17's saved view: name, createdAt (ms), state (JSON)
    assert envelope["name"] and isinstance(envelope["createdAt"], int)
    state = json.loads(envelope["state"])
    assert state["searchFilter"] == "tags.stage = 'report'"
    columns = [
        "metrics.`top1.knn`", "metrics.`top1.knn.labels_1`", "metrics.`top1.knn.labels_10`",
        "metrics.`top1.knn.pixels`", "metrics.`top1.knn.random`", "metrics.`top1.linear`",
        "metrics.`top1.linear.labels_1`", "metrics.`top1.linear.labels_10`",
        "metrics.`top1.linear.pixels`"]
    assert state["selectedColumns"] == columns
    assert state["columnOrder"][-len(columns):] == columns  # after the run name
    assert state["columnOrder"][0] == "attributes.`Run Name`"
    # a header as wide as its name (7 px a character at the table's font, checked in Chromium)
    assert state["columnWidths"]["metrics.`top1.linear.labels_10`"] >= 7 * 21
    with stage_run("linear", p):
        pass
    assert c.get_experiment(eid).tags[tag] == first  # unchanged state: not rewritten
    c.set_experiment_tag(eid, tag, "not json")
    ensure_headline_view(c, eid)
    assert json.loads(c.get_experiment(eid).tags[tag])["state"] == envelope["state"]


def test_stage_run__run_named_after_the_dvc_experiment(db, monkeypatch):
    c = MlflowClient(db)
    p = from_dict({"mlflow": {"experiment": "n"}})
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    with stage_run("knn", p) as r:
        pass
    run = c.get_run(r.run_id)
    assert (run.info.run_name, run.data.tags["dvc.exp_name"]) == ("workspace:knn", "workspace")
    monkeypatch.setenv("DVC_EXP_NAME", "famed-yawn")
    with stage_run("knn", p) as r:
        pass
    run = c.get_run(r.run_id)
    assert (run.info.run_name, run.data.tags["dvc.exp_name"]) == ("famed-yawn:knn",
                                                                  "famed-yawn")


# --- git.dirty: edits count, the pipeline's own outputs do not (#47) -------------------------

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@localhost"}
PIPELINE = """
stages:
  make:
    cmd: python make.py
    deps: [make.py]
    params: [k]
    outs:
      - ${out_dir}/model.txt:
          cache: false
    metrics:
      - ${out_dir}/metrics.json:
          cache: false
    plots:
      - curves/loss.tsv:
          cache: false
"""


@pytest.fixture()
def pipeline_repo(tmp_path, monkeypatch):
    """A committed git + DVC repo: one stage whose outputs are git-tracked (cache: false)."""

    for k, v in GIT_ENV.items():
        monkeypatch.setenv(k, v)
    repo = tmp_path / "repo"
    files = {"params.yaml": "out_dir: results\nk: 1\n", "dvc.yaml": PIPELINE,
             "make.py": "print('made')\n", "dvc.lock": "schema: '2.0'\n",
             "results/model.txt": "weights 1\n", "results/metrics.json": '{"acc": 1}\n',
             "curves/loss.tsv": "step\tloss\n0\t1.0\n", "notes.md": "notes\n"}
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    # `dvc init` in its own process: DVC's log handler holds the stderr it first saw, which
    # pytest has closed by now when an earlier test imported DVC
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "base"], cwd=repo, check=True)
    pipeline_outputs.cache_clear()
    yield repo
    pipeline_outputs.cache_clear()


def test_pipeline_outputs__outs_metrics_plots_interpolated_and_dvc_lock(pipeline_repo):
    assert pipeline_outputs(str(pipeline_repo), str(pipeline_repo)) == (
        "curves/loss.tsv", "dvc.lock", "results/metrics.json", "results/model.txt")


def test_git_state__pipeline_outputs_changed__clean(pipeline_repo):
    assert git_state(pipeline_repo)["git.dirty"] == "false"
    for f in ("results/model.txt", "results/metrics.json", "curves/loss.tsv"):
        (pipeline_repo / f).write_text("rewritten by the run\n")
    (pipeline_repo / "dvc.lock").write_text("schema: '2.0'\n# rewritten by the run\n")
    (pipeline_repo / "scratch.txt").write_text("untracked\n")
    state = git_state(pipeline_repo)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pipeline_repo, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert state == {"git.commit": head, "git.dirty": "false"}


def test_git_state__clean_tree__clean_without_reading_the_pipeline(pipeline_repo, monkeypatch):
    import pipeline.tracking.provenance as provenance

    def unread(*_):
        raise AssertionError("DVC's index read for a clean tree")

    (pipeline_repo / "scratch.txt").write_text("untracked\n")  # untracked files do not count
    monkeypatch.setattr(provenance, "pipeline_outputs", unread)
    assert git_state(pipeline_repo)["git.dirty"] == "false"
    (pipeline_repo / "results/model.txt").write_text("rewritten by the run\n")
    with pytest.raises(AssertionError, match="index read"):  # a changed file: read, and judged
        git_state(pipeline_repo)


LOCK = """schema: '2.0'
stages:
  make:
    cmd: python make.py
    outs:
    - path: results/metrics.json
      hash: md5
      md5: 0f7f0e8b2c1e6b4f2e1f0c8a9d2b3c4d
      size: 11
    - path: results/model.txt
      hash: md5
      md5: 5d41402abc4b2a76b9719d911017c592
      size: 10
"""


def test_git_state__outputs_the_lock_records__clean_without_reading_the_pipeline(
        pipeline_repo, monkeypatch):
    # during a `dvc repro` every changed file is an output dvc.lock records: no DVC index read
    import pipeline.tracking.provenance as provenance

    (pipeline_repo / "dvc.lock").write_text(LOCK)  # as DVC writes it after the stage ran
    subprocess.run(["git", "commit", "-qam", "ran"], cwd=pipeline_repo, check=True)
    read: list[str] = []
    real = provenance.pipeline_outputs
    monkeypatch.setattr(provenance, "pipeline_outputs", lambda *a: read.append("index") or real(*a))
    (pipeline_repo / "results/model.txt").write_text("weights 2\n")
    (pipeline_repo / "dvc.lock").write_text(LOCK.replace("size: 10", "size: 11"))
    assert provenance.locked_outputs(pipeline_repo) == (
        "dvc.lock", "results/metrics.json", "results/model.txt")
    assert git_state(pipeline_repo)["git.dirty"] == "false" and read == []
    # an output the lock does not record yet (its stage has not run): DVC's index decides
    (pipeline_repo / "curves/loss.tsv").write_text("step\tloss\n0\t2.0\n")
    assert git_state(pipeline_repo)["git.dirty"] == "false" and read == ["index"]
    (pipeline_repo / "notes.md").write_text("edited\n")  # not an output at all
    assert git_state(pipeline_repo)["git.dirty"] == "true"


@pytest.mark.parametrize("edit", ["make.py", "params.yaml", "notes.md", "dvc.yaml", "staged"])
def test_git_state__code_params_or_other_tracked_file_edited__dirty(pipeline_repo, edit):
    (pipeline_repo / "results/metrics.json").write_text('{"acc": 2}\n')  # an output too
    if edit == "staged":  # a rename, staged: both paths count
        subprocess.run(["git", "mv", "notes.md", "results/notes.md"], cwd=pipeline_repo,
                       check=True)
    elif edit == "params.yaml":
        (pipeline_repo / "params.yaml").write_text("out_dir: results\nk: 2\n")
    else:
        (pipeline_repo / edit).write_text((pipeline_repo / edit).read_text() + "# edited\n")
    assert git_state(pipeline_repo)["git.dirty"] == "true"


def test_git_state__not_a_git_repo__unknown(tmp_path):
    assert git_state(tmp_path) == {"git.commit": "unknown", "git.dirty": "unknown"}


# --- warnings are one line, never raw SQL (#47) ----------------------------------------------


def test_error_summary__real_sqlalchemy_failure__driver_error_first_line_only(tmp_path):
    import sqlite3

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    c.create_registered_model("m")
    con = sqlite3.connect(tmp_path / "mlflow.db")
    con.execute("CREATE TRIGGER frozen BEFORE INSERT ON registered_model_tags "
                "BEGIN SELECT RAISE(ABORT, 'tags are frozen'); END")
    con.commit()
    con.close()
    with pytest.raises(Exception) as info:
        c.set_registered_model_tag("m", "k", "v")
    assert "[SQL: INSERT INTO registered_model_tags" in str(info.value)  # what MLflow says
    assert error_summary(info.value) == "MlflowException: IntegrityError: tags are frozen"


def test_error_summary__plain_exception__type_and_first_line_cut_to_limit():
    assert error_summary(OSError("disk full\nmore detail")) == "OSError: disk full"
    assert error_summary(ValueError("")) == "ValueError: (no message)"
    long = error_summary(RuntimeError("x" * 500), limit=40)
    assert long == "RuntimeError: " + "x" * 23 + "..." and len(long) == 40
