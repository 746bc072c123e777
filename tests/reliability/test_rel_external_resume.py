"""Kill -9 and resume a run that reads WebDataset shards in place from a URL: bit-identical.

The pretraining set joins the tiny built shards (192 images) with three img2dataset-layout
shards served by ``python -m http.server`` on 127.0.0.1 (40 samples each, one broken, so 119),
read through the index (``stages/index_shards.py``) by one DataLoader worker. A run killed with
SIGKILL in the middle of its first epoch and restarted ends with the same encoder, bit for bit,
as the uninterrupted run; the index of the shards is part of the resume fingerprint.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import img2dataset_shards
from relhelpers import (
    copy_shards,
    load_state,
    run_stage,
    same_tensors,
    stage_cmd,
    stage_env,
    write_params,
)

pytestmark = pytest.mark.slow
TOTAL = 2 * ((192 + 119) // 16)  # 2 epochs of 19 steps


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv = tmp_path_factory.mktemp("srv")
    img2dataset_shards(srv / "ext", shards=3, per_shard=40, broken={1: 1}, seed=7)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", str(srv)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/ext/{{00000..00002}}.tar"
    proc.terminate()
    proc.wait(timeout=10)


def prepared(wd, tiny_shards, spec):
    copy_shards(tiny_shards, wd / "data" / "shards")
    write_params(wd / "params.yaml", {"data": {"pretrain_shards": spec,
                                               "max_broken_fraction": 0.01},
                                      "pretrain": {"num_workers": 1}}, mlflow=False)
    r = run_stage("index_shards", wd)
    assert r.returncode == 0, r.stderr[-3000:]
    # the stage's summary line of the shard set
    assert ("index_shards: data.pretrain_shards: indexed (3 shards, 119 images, 1 broken "
            "skipped)") in r.stderr.splitlines()
    return wd


def test_external_shards__sigkill_mid_epoch_then_resume__bit_identical(
        served, tiny_shards, tmp_path):
    ref = prepared(tmp_path / "ref", tiny_shards, served)
    r = run_stage("pretrain", ref, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"step 2/{TOTAL}" in r.stderr and "resuming" not in r.stderr

    wd = prepared(tmp_path / "killed", tiny_shards, served)
    proc = subprocess.Popen(stage_cmd("pretrain"), cwd=wd, env=stage_env(None),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if f" step 10/{TOTAL} " in line:  # mid-way through the first epoch (19 steps)
                break
        else:
            pytest.fail("the stage ended before the kill point:\n" + "".join(seen)[-3000:])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (wd / "models/encoder.pt").exists()

    again = run_stage("pretrain", wd, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    # the resume store keys checkpoints by the training fingerprint (pipeline/train/resume_store.py)
    m = re.search(r"resuming from \.checkpoints/pretrain/[0-9a-f]{16}/last\.pt at step (\d+)",
                  again.stderr)
    assert m, again.stderr[-3000:]
    step = int(m.group(1))
    assert 2 <= step < 19  # a checkpoint inside the first epoch
    assert same_tensors(load_state(wd / "models/encoder.pt"), load_state(ref / "models/encoder.pt"))
