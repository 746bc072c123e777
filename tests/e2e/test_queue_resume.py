"""A killed queued experiment resumes when queued again (#31): resume state in the MAIN repo.

One tiny pipeline (configs/ci.yaml shrunk; real Fashion-MNIST, 384 pretraining steps) in a fresh
git repo, and a byte-for-byte copy of it as the uninterrupted reference (``dvc repro pretrain``
there: another repo, another resume store, another run cache). In the main repo, in order:

1. ``dvc exp run --queue`` pretrain, ``dvc queue kill`` it mid-run (SIGINT to its process
   group): the last line says the checkpoint is at step S in ``<repo>/.checkpoints/pretrain/
   <fingerprint key>/last.pt``, and it is there, though DVC deleted the experiment's workspace;
2. queued again with the same params: it resumes at step S and its encoder is bit-identical to
   the reference;
3. ``dvc queue kill --force`` (SIGKILL to DVC's runner only; the stage lives on in a workspace
   DVC deletes): the stage notices, writes a checkpoint and ends with one line saying so, never
   an error about a missing ``.checkpoints`` directory or shard manifest.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from repohelpers import PROJECT_DEFAULT, make_repo, params, sh

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
EPOCHS = 12  # x 32 steps (1024 images, batch 32): long enough to kill one mid-run
STEPS = EPOCHS * 32
TINY = {
    "mlflow": {"enabled": False},
    "data": {"max_pretrain_images": 1024, "max_train_images": 200, "max_test_images": 100},
    "model": {"width": 4, "head_hidden": 16, "dim": 16},
    "moco": {"K": 64},
    "pretrain": {"epochs": EPOCHS, "batch_size": 32, "knn_every_epochs": 0,
                 "checkpoint_every_steps": 4, "log_every_steps": 2},
}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST not installed"),
              pytest.mark.skipif(shutil.which("git") is None, reason="needs git")]


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    base = tmp_path_factory.mktemp("queue-resume")
    tree = params(TINY, tiny=None)
    main, ref = base / "main", base / "ref"
    env = make_repo(main, tree, mlflow=PROJECT_DEFAULT)
    sh(["dvc", "repro", "pretrain"], ref, make_repo(ref, tree, mlflow=PROJECT_DEFAULT))
    return main, env, torch.load(ref / "models/encoder.pt", weights_only=True)


def start_queue(main: Path, env: dict) -> None:
    """``dvc queue start``, its output discarded: the worker it spawns inherits the command's
    stdout/stderr, so capturing them would wait for the worker to end."""
    subprocess.run(["dvc", "queue", "start"], cwd=main, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=300, check=True)


def queue_kicker(main: Path, env: dict, every_s: float = 30.0):
    """A predicate part that runs ``dvc queue start`` again every ``every_s`` seconds (and
    returns an empty set): a worker that was idling out as a task was queued leaves it Queued
    (treeverse/dvc#10562); docs/pipeline.md tells users to start the queue again."""
    last = [time.time()]

    def kick() -> set:
        if time.time() - last[0] >= every_s:
            start_queue(main, env)
            last[0] = time.time()
        return set()
    return kick


def run_log(main: Path, name: str, env: dict) -> Path | None:
    """The ``.out`` file of queued experiment ``name`` (None before it started)."""
    status = sh(["dvc", "queue", "status"], main, env).stdout
    m = re.search(rf"^(\w+)\s+{name}\s", status, flags=re.M)
    if not m:
        return None
    found = list((main / ".dvc/tmp/exps/run").glob(f"{m.group(1)}*/*.out"))
    return found[0] if found else None


def wait_for(pred, timeout: float, what: str, every_s: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every_s)
    pytest.fail(f"timed out waiting for {what}")


def logs(main: Path) -> set[Path]:
    return set((main / ".dvc/tmp/exps/run").glob("*/*.out"))


def status_of(main: Path, name: str, env: dict) -> str:
    m = re.search(rf"^\w+\s+{name}\s+.*?\b(Queued|Running|Success|Failed)\b",
                  sh(["dvc", "queue", "status"], main, env).stdout, flags=re.M)
    return m.group(1) if m else ""


def queue_and_kill(main: Path, env: dict, name: str, *, at_step: int, force: bool,
                   params: list[str]) -> str:
    """Queue pretrain as ``name``, kill it once it logged ``at_step``; returns its log."""
    # before queueing: a worker still running from an earlier test picks the task up (and
    # creates its log) while `dvc exp run --queue` is still returning
    before = logs(main)
    sh(["dvc", "exp", "run", "--queue", "-n", name, *params, "pretrain"], main, env)
    start_queue(main, env)
    # the new log file, then its step lines, read directly (a `dvc queue status` takes seconds)
    kick = queue_kicker(main, env)
    (log,) = wait_for(lambda: logs(main) - before or kick(), 600,
                      f"{name}'s log", every_s=0.1)
    wait_for(lambda: re.search(rf" step {at_step}/\d+ ", log.read_text()), 600,
             f"{name} at step {at_step}", every_s=0.05)
    assert "Success" != status_of(main, name, env), "finished before the kill: raise STEPS"
    sh(["dvc", "queue", "kill", *(["--force"] if force else []), name], main, env)
    wait_for(lambda: status_of(main, name, env) == "Failed", 300, f"{name} failed")
    # the stage writes its last line itself (with --force it outlives DVC's runner)
    return wait_for(lambda: "\nerror:" in log.read_text() and log.read_text(), 300,
                    f"{name}'s error line")


def experiment_output(main: Path, env: dict, name: str, path: str) -> Path:
    """The cache file of a pretrain output of experiment ``name`` (from its ``dvc.lock``)."""
    refs = sh(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], main, env).stdout.split()
    (ref,) = [r for r in refs if r.endswith(f"/{name}")]
    lock = yaml.safe_load(sh(["git", "show", f"{ref}:dvc.lock"], main, env).stdout)
    (md5,) = [o["md5"] for o in lock["stages"]["pretrain"]["outs"] if o["path"] == path]
    return main / ".dvc/cache/files/md5" / md5[:2] / md5[2:]


def last_error(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


def test_queue_kill_then_queue_again__resumes_at_its_step_bit_identical(repos):
    main, env, reference = repos
    text = queue_and_kill(main, env, "first", at_step=20, force=False, params=[])
    line = last_error(text)
    m = re.fullmatch(r"error: Terminated: SIGINT: checkpoint written at step (\d+) to (\S+); run "
                     r"the experiment again with the same params \(`dvc exp run`, `--queue` or "
                     r"`--temp`\) to continue", line)
    assert m, line
    step, ckpt = int(m.group(1)), Path(m.group(2))
    assert 20 <= step < STEPS
    assert ckpt.parent.parent == main / ".checkpoints/pretrain" and ckpt.is_file()  # main repo
    assert torch.load(ckpt, weights_only=True)["step"] == step
    assert "Traceback" not in text

    sh(["dvc", "exp", "run", "--queue", "-n", "second", "pretrain"], main, env)
    start_queue(main, env)
    kick = queue_kicker(main, env)
    wait_for(lambda: status_of(main, "second", env) in ("Success", "Failed") or kick(), 900,
             "second")
    log = run_log(main, "second", env).read_text()
    assert status_of(main, "second", env) == "Success", log[-3000:]
    assert f"resuming from {ckpt} at step {step}" in log
    got = torch.load(experiment_output(main, env, "second", "models/encoder.pt"),
                     weights_only=True)
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k]) for k in got)


def test_queue_kill_force__stage_stops_itself_with_a_true_line(repos):
    main, env, _ = repos
    text = queue_and_kill(main, env, "forced", at_step=20, force=True,
                          params=["-S", f"pretrain.epochs={EPOCHS + 1}"])
    line = last_error(text)
    # SIGTERM from the watch, or the data failing first as DVC deletes the workspace's shards;
    # the watch sees either the runner gone or the workspace already deleted, whichever is first
    m = re.fullmatch(r"error: Terminated: (?:SIGTERM|workspace abandoned): checkpoint written at "
                     r"step (\d+) to (\S+); "
                     r"(?:DVC's experiment runner \(pid \d+\) is gone, so its workspace \S+ will "
                     r"be deleted \(`dvc queue kill --force`\?\)"
                     r"|the experiment's workspace \S+ was deleted); run the experiment again with "
                     r"the same params \(`dvc exp run`, `--queue` or `--temp`\) to continue", line)
    assert m, line
    step, ckpt = int(m.group(1)), Path(m.group(2))
    assert ckpt.parent.parent == main / ".checkpoints/pretrain"
    assert torch.load(ckpt, weights_only=True)["step"] == step
    assert ".checkpoints" not in line.split(" to ", 1)[0] and "No such file" not in text
    assert "manifest not found" not in text and "Traceback" not in text
