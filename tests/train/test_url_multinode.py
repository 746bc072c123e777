"""Pretraining from shards served over HTTP (``python -m http.server`` on 127.0.0.1): the stage
script from a URL equals the same run from the local directory, bad URLs fail with one line, and
two torchrun "nodes" (c10d rendezvous on 127.0.0.1) equal one node with two processes."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import TINY, build_tiny_shards

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_shards(tmp_path):
    """Tiny real-format shards, served by ``python -m http.server`` on 127.0.0.1."""
    root = build_tiny_shards(tmp_path / "shards", n_pretrain=160, per_shard=64)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                               "127.0.0.1", "--directory", str(root)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):  # up to ~10 s for the server to listen
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError("http.server did not start")
        yield root, url
    finally:
        server.terminate()
        server.wait(timeout=10)


def _stage(workdir: Path, shards_dir: str) -> subprocess.CompletedProcess:
    """``python stages/pretrain.py --params params.yaml`` in ``workdir`` on the TINY model."""
    workdir.mkdir(parents=True, exist_ok=True)
    tree = json.loads(json.dumps(TINY))
    tree["pretrain"].update(num_threads=1, num_workers=1)
    tree.update(mlflow={"enabled": False}, data={"shards_dir": shards_dir})
    (workdir / "params.yaml").write_text(yaml.safe_dump(tree))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, str(ROOT / "stages/pretrain.py"), "--params",
                           "params.yaml"], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300)


def _same_state(a: Path, b: Path) -> bool:
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_pretrain_stage__from_url_bit_identical_to_local(http_shards, tmp_path):
    root, url = http_shards
    local = _stage(tmp_path / "local", str(root))
    assert local.returncode == 0, local.stderr[-3000:]
    remote = _stage(tmp_path / "remote", url)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert _same_state(tmp_path / "local/models/encoder.pt", tmp_path / "remote/models/encoder.pt")
    a = json.loads((tmp_path / "local/eval/metrics/pretrain.json").read_text())
    b = json.loads((tmp_path / "remote/eval/metrics/pretrain.json").read_text())
    assert a["loss"] == b["loss"] and a["steps"] == b["steps"] == 2 * (160 // 16)


def test_pretrain_stage__404_and_truncated_shard_one_line_errors(http_shards, tmp_path):
    root, url = http_shards
    missing = _stage(tmp_path / "missing", f"{url}/no-such-dir")
    assert missing.returncode == 1
    assert _error_lines(missing) == [
        f"error: ShardError: {url}/no-such-dir/pretrain/manifest.json: HTTP 404 File not found "
        "(manifest not found or unreadable)"]
    shard = root / "pretrain/shard-000002.tar"
    shard.write_bytes(shard.read_bytes()[:3000])  # the manifest still lists the full shard
    truncated = _stage(tmp_path / "truncated", url)
    assert truncated.returncode == 1
    lines = _error_lines(truncated)
    assert len(lines) == 1 and lines[0].startswith(
        f"error: ShardError: {url}/pretrain/shard-000002.tar: "), truncated.stderr[-2000:]


NODE = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch
    sys.path.insert(0, {tests!r})
    from helpers import run_pretrain
    from pipeline.data.remote import shards_location
    out = Path({out!r})
    m = run_pretrain(shards_location({shards!r}), out,
                     {{"moco": {{"bn": "shuffle"}}, "pretrain": {{"num_workers": 1}}}})
    Path(out, f"rank{{os.environ['RANK']}}.json").write_text(json.dumps(m))
""")


def _torchrun(script: Path, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, str(script)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _finish(procs: list[subprocess.Popen]) -> None:
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]


def test_pretrain__two_nodes_over_http_equal_one_node_two_processes(http_shards, tmp_path):
    root, url = http_shards
    runs = {}
    for name, shards in (("one_node", str(root)), ("two_nodes", url)):
        out = tmp_path / name
        script = tmp_path / f"{name}.py"
        script.write_text(NODE.format(tests=str(ROOT / "tests"), shards=shards, out=str(out)))
        runs[name] = (script, out)
    # 1 node x 2 processes, local shards (the reference)
    _finish([_torchrun(runs["one_node"][0], ["--nproc_per_node", "2", "--master_addr",
                                              "127.0.0.1", "--master_port",
                                              str(_free_port())])])
    # 2 "nodes" x 1 process, c10d rendezvous on 127.0.0.1, shards over HTTP
    endpoint = f"127.0.0.1:{_free_port()}"
    _finish([_torchrun(runs["two_nodes"][0],
                       ["--nnodes", "2", "--node-rank", str(rank), "--nproc_per_node", "1",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                        "--rdzv-id", "moco-test", "--local-addr", "127.0.0.1"])
             for rank in (0, 1)])
    one, two = runs["one_node"][1], runs["two_nodes"][1]
    m = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert m[0]["world_size"] == 2 and m[0]["steps"] == m[1]["steps"] == 2 * (160 // 16)
    assert m[0]["queue_ranks_identical"] == m[1]["queue_ranks_identical"] == 1
    assert _same_state(one / "encoder.pt", two / "encoder.pt")
    # the whole MoCo state at the end (both encoders, queue and its pointer) is identical too
    ca = torch.load(one / "ckpt/last.pt", weights_only=False)
    cb = torch.load(two / "ckpt/last.pt", weights_only=False)
    qa = {k: v for k, v in ca["model"].items() if "queue" in k}
    assert qa and all(torch.equal(v, cb["model"][k]) for k, v in qa.items())
