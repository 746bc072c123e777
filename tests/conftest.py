"""Shared fixtures."""

from pathlib import Path

import pytest
from helpers import build_tiny_shards


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("shards"))
