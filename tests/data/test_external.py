"""Existing WebDataset shards: expanding a shard-set string, reading a sample's members."""

from __future__ import annotations

import json
import os

import pytest

from pipeline.data.external import expand_shards, image_member, sample_label, shard_stat
from pipeline.data.remote import RemoteError


def _touch(path, data=b"x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def test_expand_shards__braces_dir_glob_and_order(tmp_path):
    for i in (0, 1, 2, 10):
        _touch(tmp_path / "s" / f"data-{i:03d}.tar")
    _touch(tmp_path / "s" / "data_stats.json")
    _touch(tmp_path / "deep" / "a" / "x.tar")
    s = tmp_path / "s"
    # braces in the order written (img2dataset numbering), and alternatives
    assert expand_shards(f"{s}/data-{{000..002}}.tar", key="k") == [
        f"{s}/data-000.tar", f"{s}/data-001.tar", f"{s}/data-002.tar"]
    assert expand_shards(f"{s}/data-{{010,000}}.tar", key="k") == [
        f"{s}/data-010.tar", f"{s}/data-000.tar"]
    # a directory: its .tar files, sorted, nothing else; a glob; ** recurses
    assert expand_shards(str(s), key="k") == [f"{s}/data-{i:03d}.tar" for i in (0, 1, 2, 10)]
    assert expand_shards(f"{s}/data-00*.tar", key="k") == [
        f"{s}/data-000.tar", f"{s}/data-001.tar", f"{s}/data-002.tar"]
    assert expand_shards(f"{tmp_path}/deep/**/*.tar", key="k") == [
        f"{tmp_path}/deep/a/x.tar"]
    # duplicates once
    assert expand_shards(f"{s}/data-{{000,000}}.tar", key="k") == [f"{s}/data-000.tar"]


def test_expand_shards__nothing_found_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"data.pretrain_shards = '.*\*.tar': no shards found"):
        expand_shards(f"{tmp_path}/*.tar", key="data.pretrain_shards")


def test_expand_shards__file_url_listed_with_fsspec(tmp_path):
    for name in ("b.tar", "a.tar", "c.txt"):
        _touch(tmp_path / name)
    assert expand_shards(f"file://{tmp_path}", key="k") == [
        f"file://{tmp_path}/a.tar", f"file://{tmp_path}/b.tar"]
    assert expand_shards(f"file://{tmp_path}/a.tar", key="k") == [f"file://{tmp_path}/a.tar"]


def test_shard_stat__size_and_change_detector(tmp_path):
    p = _touch(tmp_path / "a.tar", b"12345")
    ((n, v),) = shard_stat([p])
    assert n == 5 and v == f"mtime_ns:{os.stat(p).st_mtime_ns}"
    ((n2, v2),) = shard_stat([f"file://{p}"])
    assert n2 == 5 and v2.startswith("mtime:")
    with pytest.raises(RemoteError, match="missing.tar"):
        shard_stat([str(tmp_path / "missing.tar")])


def test_image_member__first_image_extension_any_case():
    assert image_member({"__key__": "k", "txt": b"t", "JPG": b"jpeg"}) == b"jpeg"
    assert image_member({"__key__": "k", "webp": b"w", "png": b"p"}) == b"p"
    assert image_member({"__key__": "k", "json": b"{}", "pyd": b"pickle"}) is None


def test_sample_label__cls_or_json_field():
    rec = {"__key__": "k", "cls": b" 3\n", "json": json.dumps(
        {"label": 7, "name": "cat", "flag": True, "score": 0.5}).encode()}
    assert sample_label(rec, "cls") == 3
    assert sample_label(rec, "label") == 7
    assert sample_label(rec, "name") == "cat"
    assert sample_label(rec, "missing") is None
    assert sample_label({"__key__": "k"}, "cls") is None
    for field in ("flag", "score"):
        with pytest.raises(ValueError, match=f"sample 'k': .json field '{field}'"):
            sample_label(rec, field)
    with pytest.raises(ValueError, match="sample 'k': .cls is not an integer"):
        sample_label({"__key__": "k", "cls": b"cat"}, "cls")
    with pytest.raises(ValueError, match=".json does not parse"):
        sample_label({"__key__": "k", "json": b"{"}, "label")


@pytest.fixture
def http_dir(tmp_path):
    import socket
    import subprocess
    import sys
    import time

    for name in ("b.tar", "a.tar", "notes.txt"):
        _touch(tmp_path / "srv" / name, name.encode())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", str(tmp_path / "srv")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_expand_shards__http_directory_listing_and_glob(http_dir):
    # python -m http.server's index page: its links to .tar files, sorted
    assert expand_shards(f"{http_dir}/", key="k") == [f"{http_dir}/a.tar", f"{http_dir}/b.tar"]
    assert expand_shards(f"{http_dir}/b*.tar", key="k") == [f"{http_dir}/b.tar"]
    ((n, v),) = shard_stat([f"{http_dir}/a.tar"])
    assert n == 5 and v.startswith("Last-Modified:")  # http.server sends no ETag
    with pytest.raises(RemoteError, match="missing.tar: not found"):
        shard_stat([f"{http_dir}/missing.tar"])


@pytest.fixture
def fast_retries(monkeypatch):
    from pipeline.data import remote

    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    monkeypatch.setattr(remote, "RETRIES", 2)


def test_shard_stat__server_down_is_not_called_not_found(tmp_path, fast_retries):
    # fsspec's http info raises FileNotFoundError for a refused connection too; the message
    # must say the server cannot be reached, for a shard and for a directory listing alike
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RemoteError) as e:
        shard_stat([f"{url}/pre/00000.tar"])
    assert str(e.value).startswith(f"{url}/pre/00000.tar: cannot reach it (")
    assert str(e.value).endswith("; gave up after 3 attempts)")  # refused: retried as reads are
    assert "not found" not in str(e.value)
    with pytest.raises(RemoteError) as e:
        expand_shards(f"{url}/pre/", key="data.pretrain_shards")
    assert str(e.value).startswith(f"{url}/pre/: cannot reach it (")


def test_shard_stat_and_listing__transient_503_retried_404_not(tmp_path, fast_retries):
    # a HEAD or a listing that meets a busy server is retried as reads are (index_shards
    # stopped at the first 503 before); a 404 is answered at once
    from helpers import FaultServer

    _touch(tmp_path / "a.tar", b"12345")
    server = FaultServer(tmp_path)
    try:
        server.fail["/a.tar"] = [503, 502]
        assert shard_stat([f"{server.url}/a.tar"])[0][0] == 5
        assert server.fail["/a.tar"] == []  # both faults were met, then it was served
        server.fail["/"] = [503]
        assert expand_shards(f"{server.url}/", key="k") == [f"{server.url}/a.tar"]
        server.fail["/a.tar"] = [503] * 10
        server.requests.clear()
        with pytest.raises(RemoteError) as e:
            shard_stat([f"{server.url}/a.tar"])
        assert str(e.value).startswith(f"{server.url}/a.tar: cannot reach it (ClientResponseError")
        assert str(e.value).endswith("; gave up after 3 attempts)")
        heads = [r for r in server.requests if r[1] == "/a.tar"]
        server.requests.clear()
        with pytest.raises(RemoteError, match="missing.tar: not found"):
            shard_stat([f"{server.url}/missing.tar"])
        missing = [r for r in server.requests if r[1] == "/missing.tar"]
    finally:
        server.close()
    # fsspec's info() is a HEAD then a GET per attempt: 3 attempts, and 1 for the 404
    assert len(heads) == 3 * len(missing)
