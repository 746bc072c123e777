"""The registry: one entry point, and the public names of the package."""

from __future__ import annotations

import pytest
from helpers import says

from pipeline.data.sources import SourceError, open_source


def test_open_source__unknown_name():
    with pytest.raises(ValueError, match="unknown data source 'mnist'.*fashion_mnist.*imagefolder"):
        open_source("mnist")


@pytest.mark.parametrize("name", ["cifar10", "fashion_mnist", "stl10"])
def test_open_source__download_without_network_is_one_source_error(name, tmp_path, monkeypatch):
    # what torchvision's downloader raises on a machine without DNS, as CIFAR-10's preset
    # (data.download: true) met it: a 94-line traceback before
    from urllib.error import URLError

    import torchvision.datasets.utils as tv_utils

    def offline(*args, **kwargs):
        raise URLError(OSError(-2, "Name or service not known"))

    monkeypatch.setattr(tv_utils, "urlopen", offline, raising=False)
    monkeypatch.setattr(tv_utils.urllib.request, "urlopen", offline)
    with pytest.raises(SourceError) as e:
        open_source(name, tmp_path / "raw", download=True)
    msg = str(e.value)
    assert "\n" not in msg
    says(msg, f"data.source {name}", str(tmp_path / "raw"), "Name or service not known",
         "data.download: false")


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
