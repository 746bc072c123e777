"""Stale state: a checkpoint made with other params or other shards is never resumed.

The stale checkpoint is far along (step 20 of 24): had the stage resumed it, it would log only
steps 22 and 24. Instead it must log "ignoring checkpoint", train from step 0 and end
bit-identical to the uninterrupted reference run.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import make_samples, run_pretrain
from relhelpers import TOTAL_STEPS, checkpoint_file, load_state, run_stage, same_tensors

from pipeline.data.build import write_shards
from pipeline.train.checkpoint import load_checkpoint


def other_pixels_shards(root, tiny_shards):
    """Same splits and counts as the tiny shards, but the pretrain images differ."""
    write_shards(make_samples(192, seed=7), root / "pretrain", split="pretrain",
                 source="synthetic", class_names=["a", "b", "c", "d"], mode="L",
                 samples_per_shard=64, progress=False)
    for split in ("train", "test"):
        shutil.copytree(tiny_shards / split, root / split)
    return root


def shard_hashes(split_dir):
    return [s["sha256"] for s in json.loads((split_dir / "manifest.json").read_text())["shards"]]


@pytest.mark.slow
@pytest.mark.parametrize("stale", ["params", "shards"])
def test_pretrain_stage__stale_checkpoint__ignored_and_trained_from_scratch(
        stale, workdir, tmp_path, tiny_shards, reference_run, reference_encoder):
    if stale == "params":  # same shards, another temperature
        run_pretrain(tiny_shards, tmp_path / "stale", {"moco": {"T": 0.2}}, max_steps=20)
    else:  # same params, shards rebuilt with other content
        alt = other_pixels_shards(tmp_path / "alt", tiny_shards)
        assert shard_hashes(alt / "pretrain") != shard_hashes(tiny_shards / "pretrain")
        run_pretrain(alt, tmp_path / "stale", max_steps=20)
    stale_ckpt = tmp_path / "stale/ckpt/last.pt"
    assert torch.load(stale_ckpt, weights_only=True)["step"] == 20
    # in the folder of the CURRENT fingerprint (the reference run's key): the full fingerprint
    # inside last.pt is still checked
    here = checkpoint_file(reference_run).relative_to(reference_run)
    (workdir / here).parent.mkdir(parents=True)
    shutil.copyfile(stale_ckpt, workdir / here)

    r = run_stage("pretrain", workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"ignoring checkpoint {here}" in r.stderr
    assert "starting fresh" in r.stderr and "resuming" not in r.stderr
    assert f" step 2/{TOTAL_STEPS} " in r.stderr  # trained from the first step
    assert same_tensors(load_state(workdir / "models/encoder.pt"), reference_encoder)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not_a_dict"])
def test_load_checkpoint__unreadable_file__starts_fresh_with_log(damage, tmp_path, caplog):
    path = tmp_path / "last.pt"
    good = {"fingerprint": "f" * 64, "step": 4, "model": {"w": torch.ones(3)}}
    torch.save(good, path)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "garbage":
        path.write_bytes(b"\x00not a checkpoint" * 10)
    else:
        torch.save([1, 2, 3], path)
    caplog.set_level("INFO")
    assert load_checkpoint(path, "f" * 64) is None
    assert "starting fresh" in caplog.text and str(path) in caplog.text


def test_load_checkpoint__pickled_code__refused_without_running_it(tmp_path, caplog):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "last.pt"
    torch.save({"fingerprint": "f" * 64, "step": 1, "payload": Evil()}, path)
    caplog.set_level("INFO")
    assert load_checkpoint(path, "f" * 64) is None
    assert not marker.exists()
    assert "ignoring unreadable checkpoint" in caplog.text
