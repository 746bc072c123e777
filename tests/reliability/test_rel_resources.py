"""Resources: a full disk while writing a checkpoint or shards fails cleanly, keeps the previous
file/shards byte-identical and leaves no temp file; a full ``/dev/shm`` stops the pretrain stage
with one line instead of a hang (pytorch/pytorch#5040).

The stage-level tests use a real, tiny tmpfs (``mount -t tmpfs``, root only or in a mount
namespace; skipped elsewhere); the library-level tests simulate ENOSPC inside
:func:`pipeline.atomic.write_atomic`.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch
from helpers import build_tiny_shards, processes_in, run_pretrain, says, small_shm
from PIL import Image
from relhelpers import (
    leftover_temp_files,
    load_state,
    run_stage,
    same_tensors,
    stage_cmd,
    stage_env,
    store_path,
    tree_digest,
    write_params,
)

import pipeline.atomic as atomic


@pytest.fixture()
def tmpfs(tmp_path):
    """A 4 MiB tmpfs mounted at ``tmp_path/mnt`` (unmounted afterwards)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); see the ENOSPC "
                    "simulations below")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)])


def fill(mnt, leave: int) -> None:
    """Fill the filesystem at ``mnt`` until only about ``leave`` bytes are free."""
    st = os.statvfs(mnt)
    free = st.f_bavail * st.f_frsize
    assert free > leave
    with open(mnt / "filler", "wb") as f:
        f.write(b"\x01" * (free - leave))
    st = os.statvfs(mnt)
    assert st.f_bavail * st.f_frsize <= leave + 8192


@pytest.mark.slow
def test_pretrain_stage__disk_full_at_checkpoint__previous_checkpoint_intact(
        tmpfs, tmp_path, tiny_shards, reference_encoder):
    run_pretrain(tiny_shards, tmp_path / "prev", max_steps=2)
    prev = tmp_path / "prev/ckpt/last.pt"
    wd = tmpfs / "wd"
    ckpt = store_path(wd, torch.load(prev, weights_only=True)["fingerprint"])
    ckpt.parent.mkdir(parents=True)
    shutil.copyfile(prev, ckpt)
    write_params(wd / "params.yaml", {"data": {"shards_dir": str(tiny_shards)}}, mlflow=False)
    fill(tmpfs, leave=prev.stat().st_size // 2)  # the next checkpoint cannot fit
    before = tree_digest(wd)

    r = run_stage("pretrain", wd)
    assert r.returncode != 0
    assert f"resuming from {ckpt.relative_to(wd)} at step 2" in r.stderr
    assert "No space left on device" in r.stderr.strip().splitlines()[-1], r.stderr[-3000:]
    assert tree_digest(wd) == before  # the step-2 checkpoint is byte-identical, nothing added
    assert leftover_temp_files(tmpfs) == []
    assert torch.load(ckpt, weights_only=True)["step"] == 2

    (tmpfs / "filler").unlink()  # space again: the run resumes and completes
    r = run_stage("pretrain", wd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert same_tensors(load_state(wd / "models/encoder.pt"), reference_encoder)


@pytest.mark.slow
def test_pretrain_stage__dev_shm_full__one_error_line_exit_no_worker_left(tmp_path):
    # 128 x 128 grey images: a batch of 16 is 256 KiB, twice the 128 KiB /dev/shm, which holds
    # the loader's queues (about 40 KiB of semaphores)
    wd = tmp_path / "wd"
    build_tiny_shards(wd / "data/shards", n_pretrain=64, n_train=16, n_test=16, size=128)
    write_params(wd / "params.yaml", {"pretrain": {"num_workers": 1}}, mlflow=False)

    t0 = time.monotonic()
    r = subprocess.run([*small_shm("128k"), *stage_cmd("pretrain")], cwd=wd, env=stage_env(None),
                       capture_output=True, text=True, timeout=120)  # today: waits forever
    assert time.monotonic() - t0 < 60
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [r.stderr.strip().splitlines()[-1]], r.stderr[-3000:]
    says(errors[0], "error: SharedMemoryError: shared memory /dev/shm (size 128 KiB,",
         "a batch of DataLoader worker (pid ", "--shm-size", "`pretrain.num_workers: 0`",
         "checkpoint written at step 0")
    assert " step 1/" not in r.stderr  # no step ran
    assert processes_in(wd) == []  # the stage and its worker are gone


@pytest.mark.slow
def test_build_shards_stage__disk_full__previous_shards_intact(tmpfs, tmp_path, tiny_shards):
    rng = np.random.default_rng(0)
    images = tmp_path / "images"
    for c in ("a", "b"):
        (images / c).mkdir(parents=True)
        for i in range(40):
            Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8), "L").save(
                images / c / f"{i}.png")
    shards = shutil.copytree(tiny_shards, tmpfs / "shards")
    wd = tmp_path / "wd"
    write_params(wd / "params.yaml", {"data": {
        "source": "imagefolder", "root": str(images), "shards_dir": str(shards),
        "samples_per_shard": 16}}, mlflow=False)
    fill(tmpfs, leave=64 * 1024)  # the new shards need ~3 x 80 x 2 KiB
    before = tree_digest(shards)

    r = run_stage("build_shards", wd)
    assert r.returncode != 0
    assert "No space left on device" in r.stderr.strip().splitlines()[-1], r.stderr[-3000:]
    assert tree_digest(shards) == before
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler", "shards"]  # no temp dirs

    (tmpfs / "filler").unlink()
    r = run_stage("build_shards", wd)  # with space, the same command replaces them whole
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in tmpfs.iterdir()) == ["shards"]
    assert tree_digest(shards) != before


class _FullDisk:
    """A file object that accepts ``capacity`` bytes, then raises ENOSPC (partial write)."""

    def __init__(self, f, capacity: int):
        self._f, self._left = f, capacity

    def write(self, b) -> int:
        b = bytes(b)
        if len(b) > self._left:
            self._f.write(b[: self._left])
            self._left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= len(b)
        return self._f.write(b)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


WRITERS = {
    "save_torch": lambda p, v: atomic.save_torch({"w": torch.full((4096,), float(v))}, p),
    "write_json": lambda p, v: atomic.write_json(p, {"value": v, "pad": "x" * 5000}),
    "write_tsv": lambda p, v: atomic.write_tsv(p, ["a", "b"], [{"a": v, "b": i}
                                                              for i in range(1000)]),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_write_atomic__disk_full_mid_write__previous_file_intact(writer, tmp_path,
                                                                 monkeypatch):
    path = tmp_path / "out" / "target.bin"
    WRITERS[writer](path, 1)
    before = path.read_bytes()
    real_fdopen = os.fdopen
    monkeypatch.setattr(atomic.os, "fdopen",
                        lambda fd, *a, **k: _FullDisk(real_fdopen(fd, *a, **k), 1000))
    with pytest.raises(OSError) as e:
        WRITERS[writer](path, 2)
    monkeypatch.undo()
    assert e.value.errno == errno.ENOSPC
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["target.bin"]


def test_write_atomic__disk_full_on_first_write__no_file_at_all(tmp_path, monkeypatch):
    real_fdopen = os.fdopen
    monkeypatch.setattr(atomic.os, "fdopen",
                        lambda fd, *a, **k: _FullDisk(real_fdopen(fd, *a, **k), 10))
    with pytest.raises(OSError):
        atomic.write_json(tmp_path / "m.json", {"loss": 1.0, "steps": 24})
    assert list(tmp_path.iterdir()) == []
