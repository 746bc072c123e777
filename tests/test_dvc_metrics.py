"""What DVC shows of the committed metrics/: a few columns, short lines, numbers in order.

`dvc exp show` is where runs are compared; before issue 54 it listed 227 metric columns (144 of
them label-efficiency curve points) and `dvc metrics show` printed lines of 5,678 characters.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METRICS = sorted(p.relative_to(ROOT) for p in (ROOT / "metrics").glob("*.json"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> tuple[Path, str, dict]:
    """A git + DVC repo holding dvc.yaml, params.yaml and the committed metrics/, one commit."""
    dst = tmp_path_factory.mktemp("metrics")
    for f in (Path("dvc.yaml"), Path("params.yaml"), *METRICS):
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, dst / f)
    dvc = str(Path(sys.executable).parent / "dvc")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "ci",
           "GIT_AUTHOR_EMAIL": "ci@localhost", "GIT_COMMITTER_NAME": "ci",
           "GIT_COMMITTER_EMAIL": "ci@localhost"}
    for cmd in (["git", "init", "-q"], [dvc, "init", "-q"], ["git", "add", "-A"],
                ["git", "commit", "-qm", "metrics"]):
        subprocess.run(cmd, cwd=dst, env=env, check=True, capture_output=True)
    return dst, dvc, env


def run(repo: tuple[Path, str, dict], *args: str) -> str:
    dst, dvc, env = repo
    out = subprocess.run([dvc, *args], cwd=dst, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def leaves(obj) -> int:
    return sum(leaves(v) for v in obj.values()) if isinstance(obj, dict) else 1


def test_dvc_exp_show__at_most_40_metric_columns(repo):
    (workspace, *_) = json.loads(run(repo, "exp", "show", "--json"))
    files = workspace["data"]["metrics"]
    assert sorted(files) == [str(p) for p in METRICS]
    assert leaves({f: entry["data"] for f, entry in files.items()}) <= 40


def test_dvc_metrics_show__no_line_over_240_characters(repo):
    # DVC puts every file's keys in one header: each stage's headline widens every line
    # (221 characters with select_labels' at_20.knn and at_20.linear)
    lines = run(repo, "metrics", "show").splitlines()
    assert len(lines) == 1 + len(METRICS)  # the header and one line per file
    assert max(len(ln) for ln in lines) <= 240, max(len(ln) for ln in lines)


def test_dvc_metrics_show__numbered_keys_in_numeric_order(repo):
    # columns that differ only in their numbers (knn.1, knn.10) appear in numeric order: DVC
    # sorts them as text ("1", "10", "100", "2" was the label-efficiency curve)
    header = run(repo, "metrics", "show").splitlines()[0].split()[1:]
    shapes: dict[str, list[tuple[int, ...]]] = {}
    for col in header:
        numbers = tuple(int(n) for n in re.findall(r"(?<![A-Za-z])\d+", col))
        if numbers:
            shapes.setdefault(re.sub(r"(?<![A-Za-z])\d+", "#", col), []).append(numbers)
    assert shapes, header  # the label-efficiency points are numbered
    for shape, numbers in shapes.items():
        assert numbers == sorted(numbers), (shape, numbers)
