"""Shared fixtures; ``gpu``-marked tests are skipped where CUDA is not available."""

from pathlib import Path

import pytest
import torch
from helpers import build_tiny_shards


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("shards"))
