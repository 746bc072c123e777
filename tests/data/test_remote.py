"""Shards read from URLs: a real HTTP server on 127.0.0.1, fsspec ``file://``, retries, errors."""

import http.server
import shutil
import threading
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_shards

from pipeline.data import remote
from pipeline.data.loader import eval_loader, train_loader
from pipeline.data.remote import RemoteError, ShardURL, open_stream, read_url, shards_location
from pipeline.data.shards import ShardError, read_manifest
from pipeline.data.views import build_eval_transform


class _Server:
    """``http.server`` on 127.0.0.1 (ephemeral port) over a directory, in a thread.

    ``fail`` maps a URL path to a list of HTTP status codes answered (and consumed) before the
    file is served; ``drop`` maps a URL path to a number of responses that announce the whole
    file but close the connection halfway.
    """

    def __init__(self, directory: Path):
        fail: dict[str, list[int]] = {}
        drop: dict[str, int] = {}
        self.fail, self.drop, self.requests = fail, drop, []
        requests = self.requests

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **kw):
                super().__init__(*a, directory=str(directory), **kw)

            def do_GET(self):  # noqa: N802 (http.server API)
                requests.append(self.path)
                codes = fail.get(self.path)
                if codes:
                    self.send_error(codes.pop(0))
                    return
                if drop.get(self.path):
                    drop[self.path] -= 1
                    data = (directory / self.path.lstrip("/")).read_bytes()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[:len(data) // 2])
                    self.close_connection = True
                    return
                super().do_GET()

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = build_tiny_shards(tmp_path_factory.mktemp("served"), n_pretrain=160, per_shard=64)
    server = _Server(root)
    yield root, server
    server.close()


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    monkeypatch.setattr(remote, "RETRIES", 2)


def _batches(loader):
    return [(x.clone(), keys) for x, keys in loader]


def test_shard_url__joins_like_a_path():
    base = shards_location("https://example.org/data/shards/")
    assert isinstance(base, ShardURL)
    assert str(base / "pretrain" / "manifest.json") == \
        "https://example.org/data/shards/pretrain/manifest.json"
    assert (base / "test").name == "test" and base.scheme == "https"
    assert shards_location("data/shards") == Path("data/shards")
    assert isinstance(shards_location("s3://bucket/x"), ShardURL)
    with pytest.raises(TypeError):
        Path(base)  # never silently collapsed into a local path


@pytest.mark.parametrize("num_workers", [0, 2])
def test_train_loader__http_equals_local(served, num_workers):
    root, server = served
    kw = dict(batch_size=16, steps=4, epoch=1, seed=3, rank=1, world_size=2,
              num_workers=num_workers)
    local = _batches(train_loader(root / "pretrain", **kw))
    http = _batches(train_loader(f"{server.url}/pretrain", **kw))
    assert len(local) == len(http) == 4
    for (a, ka), (b, kb) in zip(local, http, strict=True):
        assert ka == kb and torch.equal(a, b)


def test_eval_loader__http_and_fsspec_equal_local(served):
    root, server = served
    tf = build_eval_transform(16, [0.5], [0.5])
    local = list(eval_loader(root / "test", transform=tf, batch_size=10, num_workers=2))
    for url in (f"{server.url}/test", f"file://{root}/test"):
        got = list(eval_loader(shards_location(url), transform=tf, batch_size=10,
                               num_workers=2))
        assert len(got) == len(local) == 5  # 48 images in batches of 10
        for (xa, ya, ka), (xb, yb, kb) in zip(local, got, strict=True):
            assert ka == kb and torch.equal(ya, yb) and torch.equal(xa, xb)


def test_read_manifest__404_names_the_url_at_once(served, fast_retries):
    _, server = served
    before = len(server.requests)
    with pytest.raises(ShardError) as e:
        read_manifest(f"{server.url}/nope")
    msg = str(e.value)
    assert f"{server.url}/nope/manifest.json: HTTP 404" in msg and "\n" not in msg
    assert len(server.requests) - before == 1  # 404 is not retried


def test_open_stream__retries_transient_errors_then_succeeds(served, fast_retries):
    root, server = served
    server.fail["/test/manifest.json"] = [503, 502]
    data = read_url(f"{server.url}/test/manifest.json")
    assert data == (root / "test/manifest.json").read_bytes()


def test_train_loader__connection_dropped_mid_shard_resumes(served, fast_retries):
    root, server = served
    kw = dict(batch_size=16, steps=10, epoch=0, seed=1)
    server.drop["/pretrain/shard-000000.tar"] = 2  # two cut transfers, then a whole one
    got = _batches(train_loader(f"{server.url}/pretrain", **kw))
    assert server.drop["/pretrain/shard-000000.tar"] == 0
    local = _batches(train_loader(root / "pretrain", **kw))
    assert all(ka == kb and torch.equal(a, b)
               for (a, ka), (b, kb) in zip(local, got, strict=True)) and len(got) == 10


def test_open_stream__gives_up_after_the_last_retry(served, fast_retries):
    _, server = served
    server.fail["/test/manifest.json"] = [503] * 3  # first try + RETRIES=2
    with pytest.raises(RemoteError) as e:
        open_stream(f"{server.url}/test/manifest.json")
    assert str(e.value) == (f"{server.url}/test/manifest.json: HTTP 503 Service Unavailable "
                            "(gave up after 3 attempts)")


def test_open_stream__connection_refused_is_retried_and_named(fast_retries):
    import socket

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/x"
    with pytest.raises(RemoteError) as e:
        open_stream(url)
    assert str(e.value).startswith(f"{url}: ") and "gave up after 3 attempts" in str(e.value)


@pytest.fixture
def broken(tmp_path, served):
    """A copy of the served shards whose pretrain shard 1 will be damaged, served anew."""
    root = tmp_path / "broken"
    shutil.copytree(served[0], root)
    server = _Server(root)
    yield root, server
    server.close()


def _tar_member_end(shard: Path, index: int) -> int:
    import tarfile

    with tarfile.open(shard) as t:
        m = t.getmembers()[index]
    return m.offset_data + ((m.size + 511) // 512) * 512


@pytest.mark.parametrize(("cut", "num_workers"),
                         [("mid_member", 0), ("member_boundary", 0), ("mid_member", 1)])
def test_train_loader__truncated_url_shard_fails_naming_it(broken, cut, num_workers):
    root, server = broken
    shard = root / "pretrain/shard-000001.tar"
    data = shard.read_bytes()
    end = _tar_member_end(shard, 9) if cut == "member_boundary" else len(data) // 2 + 100
    shard.write_bytes(data[:end])  # the manifest still describes the full shard
    loader = train_loader(f"{server.url}/pretrain", batch_size=16, steps=10, epoch=0, seed=0,
                          num_workers=num_workers)
    with pytest.raises(ShardError) as e:
        _batches(loader)
    msg = str(e.value)
    assert msg.startswith(f"{server.url}/pretrain/shard-000001.tar: ") and "\n" not in msg
    assert "manifest says 133120 (truncated or altered)" in msg  # the manifest's bytes of shard 1


def test_eval_loader__altered_url_shard_fails_on_sha256(broken):
    from helpers import relabel_first_sample

    root, server = broken
    relabel_first_sample(root / "test/shard-000000.tar")  # same size, still decodes
    tf = build_eval_transform(16, [0.5], [0.5])
    with pytest.raises(ShardError) as e:
        list(eval_loader(f"{server.url}/test", transform=tf, batch_size=16))
    assert str(e.value).startswith(f"{server.url}/test/shard-000000.tar: sha256 ")


def test_verify_shards__url_root_and_altered_shard(served, broken, capsys):
    from helpers import relabel_first_sample

    from pipeline.__main__ import verify_main

    _, server = served
    assert verify_main(server.url) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[0] for line in out] == [
        f"ok  {server.url}/{split}" for split in ("pretrain", "train", "test")]
    assert "160 samples in 3 shard(s)" in out[0]
    root, bad = broken
    relabel_first_sample(root / "train/shard-000000.tar")
    assert verify_main(f"{bad.url}/train") == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: verify-shards: {bad.url}/train/shard-000000.tar: sha256 ")


def test_build_all__refuses_a_url_shards_dir():
    from pipeline.config import from_dict
    from pipeline.data.build import build_all

    p = from_dict({"data": {"shards_dir": "https://example.org/shards"}})
    with pytest.raises(ShardError, match=r"^data.shards_dir = https://example.org/shards: "
                                         "build_shards writes a local directory"):
        build_all(p.data, 0, progress=False)
