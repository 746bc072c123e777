"""Shared fixtures; ``gpu``-marked tests are skipped where CUDA is not available; under
pytest-xdist (``make test``: ``-n auto``) each worker gets its share of the cores for torch."""

import os
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_shards


def pytest_configure(config: pytest.Config) -> None:
    # N workers each with torch's default (every core) would run N x cores threads on the
    # cores; OpenMP's spinning threads then slow each other down. Stage subprocesses the tests
    # start choose their own threads (the tiny e2e recipes run with OMP_NUM_THREADS=1).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


@pytest.hookimpl(optionalhook=True)  # known only where pytest-xdist is loaded
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    # `-n auto`: on up to 4 usable cores, half as many workers again (2 cores: 3 workers). The
    # e2e tests spend part of their time waiting (stage subprocesses starting, git and DVC on
    # disk); a third worker fills those waits: the whole suite took 1,195 s with 3 workers on 2
    # cores, 1,362 s with 2 (fresh clones, cold caches; two runs a session apart). Above 4
    # cores, one per core.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    return cores + (cores + 1) // 2 if cores <= 4 else cores


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Longest first: the e2e files (60-270 s each), then the other files with slow tests, then
    # the rest; within a file, its own order (e2e tests build on each other). `make test` keeps
    # this order (--no-loadscope-reorder) so no long file starts last while the other worker idles.
    rank: dict[Path, int] = {}
    for item in items:
        here = 0 if "e2e" in item.path.parts else 1 if item.get_closest_marker("slow") else 2
        rank[item.path] = min(rank.get(item.path, 2), here)
    items.sort(key=lambda item: rank[item.path])
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("shards"))


@pytest.fixture()
def db(tmp_path, monkeypatch):
    """A fresh MLflow SQLite database in ``tmp_path`` (the working directory), as its URI."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    yield uri
    mlflow.set_tracking_uri(None)
