"""Shards read from URLs: a real HTTP server on 127.0.0.1, fsspec ``file://``, retries, errors."""

import hashlib
import shutil
import socket
from pathlib import Path

import pytest
import torch
from helpers import FaultServer, build_tiny_shards

from pipeline.data import remote
from pipeline.data.eval_loader import eval_loader
from pipeline.data.loader import train_loader
from pipeline.data.remote import RemoteError, ShardURL, open_stream, read_url, shards_location
from pipeline.data.shards import ShardError, read_manifest
from pipeline.data.views import build_eval_transform


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = build_tiny_shards(tmp_path_factory.mktemp("served"), n_pretrain=160, per_shard=64)
    server = FaultServer(root)
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
    assert str(e.value) == (f"{server.url}/nope/manifest.json: HTTP 404 File not found "
                            "(manifest not found or unreadable)")
    # one attempt (fsspec's info() asks HEAD, then GET); 404 is not retried
    assert server.requests[before:] == [("HEAD", "/nope/manifest.json", None),
                                        ("GET", "/nope/manifest.json", None)]


@pytest.mark.parametrize("fault", ["fail", "fail_get"])
def test_open_stream__retries_transient_errors_then_succeeds(served, fast_retries, fault):
    root, server = served
    getattr(server, fault)["/test/manifest.json"] = [503, 502]
    data = read_url(f"{server.url}/test/manifest.json")
    assert data == (root / "test/manifest.json").read_bytes()
    assert getattr(server, fault)["/test/manifest.json"] == []


def test_train_loader__connection_dropped_mid_shard_resumes(served, fast_retries):
    root, server = served
    kw = dict(batch_size=16, steps=10, epoch=0, seed=1)
    server.drop["/pretrain/shard-000000.tar"] = 2  # two cut transfers, then a whole one
    got = _batches(train_loader(f"{server.url}/pretrain", **kw))
    assert server.drop["/pretrain/shard-000000.tar"] == 0
    local = _batches(train_loader(root / "pretrain", **kw))
    assert all(ka == kb and torch.equal(a, b)
               for (a, ka), (b, kb) in zip(local, got, strict=True)) and len(got) == 10


@pytest.fixture
def blob(tmp_path):
    """``serve(**server_kw)`` -> ``(data, server, url)``: 256 KiB of seeded random bytes on a
    fresh :class:`helpers.FaultServer`."""
    data = torch.randint(0, 256, (1 << 18,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    (tmp_path / "blob.bin").write_bytes(data)
    servers = []

    def serve(**kw):
        servers.append(FaultServer(tmp_path, **kw))
        return data, servers[-1], f"{servers[-1].url}/blob.bin"

    yield serve
    for server in servers:
        server.close()


def _read_all(stream) -> bytes:
    with stream as f:
        out = f.readall()
    assert f.pos == len(out) and f.sha256.hexdigest() == hashlib.sha256(out).hexdigest()
    return out


@pytest.mark.parametrize("ranges", [True, False])
def test_open_stream__stalled_body_times_out_and_resumes_at_the_byte_reached(blob, fast_retries,
                                                                              ranges):
    data, server, url = blob(ranges=ranges, stall_s=3.0)
    server.stall["/blob.bin"] = 1  # half the body, then silence past the 0.5 s read timeout
    assert _read_all(open_stream(url, timeout=0.5)) == data
    gets = [r for r in server.requests if r[0] == "GET"]
    # the retry asks for the rest; a server that ignores Range sends all again (prefix dropped)
    assert gets == [("GET", "/blob.bin", None), ("GET", "/blob.bin", f"bytes={len(data) // 2}-")]


@pytest.mark.parametrize("ranges", [True, False])
def test_open_stream__reset_mid_body_once_then_serves(blob, fast_retries, ranges):
    data, server, url = blob(ranges=ranges)
    server.reset["/blob.bin"] = 1
    assert _read_all(open_stream(url)) == data
    assert server.reset["/blob.bin"] == 0 and len([r for r in server.requests
                                                   if r[0] == "GET"]) == 2


def test_open_stream__body_shorter_than_content_length_every_time_gives_up(blob, fast_retries):
    _, server, url = blob()
    server.drop["/blob.bin"] = 100
    with pytest.raises(RemoteError) as e:
        _read_all(open_stream(url))
    msg = str(e.value)
    assert msg.startswith(f"{url}: ClientPayloadError: Response payload is not completed")
    assert msg.endswith("(gave up after 3 attempts)") and "\n" not in msg
    assert 100 - server.drop["/blob.bin"] >= 3  # progress resets the count of attempts


def test_open_stream__slow_server_times_out_and_gives_up(blob, fast_retries):
    _, server, url = blob(stall_s=2.0)
    server.stall["/blob.bin"] = 100
    with pytest.raises(RemoteError) as e:
        _read_all(open_stream(url, timeout=0.3))
    assert str(e.value) == f"{url}: timed out (gave up after 3 attempts)"


def test_open_stream__gives_up_after_the_last_retry(blob, fast_retries):
    _, server, url = blob()
    server.fail["/blob.bin"] = [503] * 100  # HEAD and GET
    with pytest.raises(RemoteError) as e:
        open_stream(url)
    assert str(e.value) == f"{url}: HTTP 503 Service Unavailable (gave up after 3 attempts)"
    assert len([r for r in server.requests if r[0] == "GET"]) == 3  # first try + RETRIES=2


@pytest.mark.parametrize("fault", ["fail", "fail_get"])
def test_open_stream__403_fails_at_once(blob, fast_retries, fault):
    _, server, url = blob()
    getattr(server, fault)["/blob.bin"] = [403, 403]
    with pytest.raises(RemoteError) as e:
        open_stream(url)
    assert str(e.value) == f"{url}: HTTP 403 Forbidden"
    assert len([r for r in server.requests if r[0] == "GET"]) == 1  # not retried


def test_open_stream__missing_fsspec_file_fails_at_once(tmp_path, fast_retries):
    url = f"file://{tmp_path}/nope.json"
    with pytest.raises(RemoteError) as e:
        read_url(url)
    assert str(e.value).startswith(f"{url}: FileNotFoundError: ") and "gave up" not in str(e.value)


def test_open_stream__connection_refused_is_retried_and_named(fast_retries):
    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/x"
    with pytest.raises(RemoteError) as e:
        open_stream(url)
    assert str(e.value).startswith(f"{url}: ClientConnectorError: Cannot connect to host")
    assert str(e.value).endswith("(gave up after 3 attempts)")


@pytest.fixture
def broken(tmp_path, served):
    """A copy of the served shards whose pretrain shard 1 will be damaged, served anew."""
    root = tmp_path / "broken"
    shutil.copytree(served[0], root)
    server = FaultServer(root)
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
