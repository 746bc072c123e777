"""The registry: one entry point, and the public names of the package."""

from __future__ import annotations

import pytest

from pipeline.data.sources import open_source


def test_open_source__unknown_name():
    with pytest.raises(ValueError, match="unknown data source 'mnist'.*fashion_mnist.*imagefolder"):
        open_source("mnist")


def test_package__public_names_importable():
    # every name that code outside the package imports (pipeline/cli.py, shards.py, tests,
    # benchmarks) keeps working from the package, with the classes defined in their modules
    import pipeline.data.sources as sources
    from pipeline.data.sources import SPLITS, Sample, SourceError  # noqa: F401

    for name in sources.__all__:
        assert hasattr(sources, name), name
    assert sources.open_source.__module__ == "pipeline.data.sources.registry"
    assert sources.verify_file.__module__ == "pipeline.data.sources.checksum"
    assert sources.ImageFolderSource.__module__ == "pipeline.data.sources.imagefolder"
    assert issubclass(sources.ChecksumError, sources.SourceError)
    assert SPLITS == ("pretrain", "train", "test")
    # every data.source name of the schema reaches a reader: an empty root is refused by
    # the reader itself (SourceError), never as an unknown name
    from pipeline.config import DataSource

    for name in DataSource.names():
        if name == "none":  # no labelled images, no root to read
            assert sources.open_source(name, "/nonexistent-root").splits() == {
                "pretrain": 0, "train": 0, "test": 0}
            continue
        with pytest.raises(sources.SourceError):
            sources.open_source(name, "/nonexistent-root")
