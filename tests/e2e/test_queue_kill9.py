"""A queued experiment whose worker was SIGKILLed: what docs/pipeline.md says to run (#47).

``kill -9`` on DVC's queue worker (here its whole process group: the worker, DVC's runner and
the stage, as the OOM killer or a ``kill -9 -PGID`` leaves them) gives the task no chance to
record an end: ``dvc queue status`` says ``Running`` for ever (and ``dvc exp remove`` refuses
the name). ``dvc queue kill`` marks it ``Failed``, ``dvc queue remove --failed`` drops it, and
the same experiment queued again resumes pretraining from its checkpoint in the main repo. A
tiny repo (tests/e2e/repohelpers.py) on real Fashion-MNIST, 384 pretraining steps, a checkpoint
every 4.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from repohelpers import make_repo, params, sh

FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST not installed"),
              pytest.mark.skipif(shutil.which("git") is None, reason="needs git")]


def wait_for(pred, timeout: float, what: str, every_s: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every_s)
    pytest.fail(f"timed out waiting for {what}")


def status(dst: Path, env: dict, name: str) -> list[str]:
    """The statuses ``dvc queue status`` lists for experiment ``name``, newest task last."""
    table = sh(["dvc", "queue", "status"], dst, env).stdout
    return re.findall(rf"^\w+\s+{name}\s+.*?\b(Queued|Running|Success|Failed)\b", table, re.M)


def start_queue(dst: Path, env: dict) -> None:
    """``dvc queue start``; its worker inherits stdout/stderr, so they are not captured."""
    subprocess.run(["dvc", "queue", "start"], cwd=dst, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=300, check=True)


def test_queue_worker_killed_9__queue_kill_remove_and_queue_again_resumes(tmp_path):
    dst = tmp_path / "repo"
    env = make_repo(dst, params({
        "mlflow": {"enabled": False},
        "data": {"max_pretrain_images": 1024, "max_train_images": 200, "max_test_images": 100},
        "pretrain": {"epochs": 12, "checkpoint_every_steps": 4, "knn_every_epochs": 0}}))
    runs = dst / ".dvc/tmp/exps/run"
    sh(["dvc", "exp", "run", "--queue", "-n", "doomed", "pretrain"], dst, env)
    start_queue(dst, env)
    (task,) = wait_for(lambda: list(runs.glob("*/*.pid")), 300, "the task's pid file")
    log = task.with_suffix(".out")
    wait_for(lambda: log.is_file() and re.search(r" step (2\d|[3-9]\d)/384 ", log.read_text()),
             600, "pretraining at step 20", every_s=0.05)
    group = os.getpgid(int(task.read_text()))  # DVC's runner: the worker's process group
    assert group != os.getpgid(0)  # never this test's own group
    os.killpg(group, signal.SIGKILL)  # kill -9 -PGID
    killed_at = int(re.findall(r" step (\d+)/384 ", log.read_text())[-1])
    time.sleep(5)
    assert status(dst, env, "doomed") == ["Running"]  # for ever: nobody is left to end it
    refused = sh(["dvc", "exp", "remove", "doomed"], dst, env, ok=False)
    assert refused.returncode != 0
    assert "'doomed' is not a valid experiment name" in refused.stdout + refused.stderr

    killed = sh(["dvc", "queue", "kill", "doomed"], dst, env)
    assert "had already aborted unexpectedly" in killed.stdout + killed.stderr
    assert status(dst, env, "doomed") == ["Failed"]
    removed = sh(["dvc", "queue", "remove", "--failed"], dst, env)
    assert removed.stdout.strip() == "Removed tasks in queue: doomed"
    assert status(dst, env, "doomed") == []

    sh(["dvc", "exp", "run", "--queue", "-n", "doomed", "pretrain"], dst, env)  # the same params
    start_queue(dst, env)
    wait_for(lambda: status(dst, env, "doomed") in (["Success"], ["Failed"]), 900,
             "the queued-again experiment", every_s=3)
    (again,) = [p for p in runs.glob("*/*.out") if p != log]
    text = again.read_text()
    assert status(dst, env, "doomed") == ["Success"], text[-3000:]
    m = re.search(r"resuming from (\S+/\.checkpoints/pretrain/\w+/last\.pt) at step (\d+)", text)
    assert m, text[-3000:]
    assert Path(m.group(1)).parent.parent == dst / ".checkpoints/pretrain"
    # the last checkpoint completed before the kill: a multiple of 4, written right after its
    # step's log line (so the one of step killed_at itself may have been cut short)
    step = int(m.group(2))
    assert step % 4 == 0 and killed_at - 4 <= step <= killed_at, (step, killed_at)
    assert " step 384/384 " in text
