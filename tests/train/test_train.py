import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from helpers import TINY, build_tiny_shards, run_pretrain
from PIL import Image

from pipeline.evaluate.run.embed import load_encoder
from pipeline.schedules import lr_schedule
from pipeline.train.engine import NonFiniteLossError
from pipeline.train.runtime import resolve_precision

ROOT = Path(__file__).resolve().parents[2]

def same_state(a: Path, b: Path) -> bool:
    sa = torch.load(a, weights_only=True)
    sb = torch.load(b, weights_only=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_resolve_precision__auto_is_fp32_on_cpu_without_native_bf16():
    assert resolve_precision("auto", torch.device("cpu"), native_bf16=lambda: False) is None
    assert resolve_precision("bf16", torch.device("cpu")) is torch.bfloat16
    assert resolve_precision("fp32", torch.device("cuda")) is None


def test_lr_schedule__scaling_warmup_cosine_and_steps():
    # lr per 256 images scaled to the batch: 0.06 * 512 / 256 = 0.12
    lrs = lr_schedule(base_lr=0.06, batch_size=512, total_steps=10, steps_per_epoch=5,
                      schedule="cosine")
    assert len(lrs) == 10 and lrs[0] == pytest.approx(0.12)
    assert lrs[5] == pytest.approx(0.12 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    warm = lr_schedule(base_lr=0.03, batch_size=256, total_steps=10, steps_per_epoch=2,
                       schedule="cosine", warmup_epochs=1)
    assert warm[:2] == pytest.approx([0.015, 0.03])
    step = lr_schedule(base_lr=0.03, batch_size=256, total_steps=8, steps_per_epoch=2,
                       schedule="step", milestones=[2, 3])
    assert step == pytest.approx([0.03] * 4 + [0.003] * 2 + [0.0003] * 2)


def test_pretrain__exports_plain_backbone_and_outputs(tiny_shards, tmp_path):
    m = run_pretrain(tiny_shards, tmp_path)
    assert m["steps"] == 2 * (192 // 16) and math.isfinite(m["loss"])
    rows = (tmp_path / "plots.tsv").read_text().splitlines()
    assert rows[0].split("\t")[:3] == ["step", "epoch", "loss"]
    assert len(rows) == 1 + m["steps"] // 2
    backbone, meta = load_encoder(tmp_path / "encoder.pt")
    assert meta["in_channels"] == 1 and meta["small_stem"] is True
    assert meta["stem_stride"] == 2 and backbone.conv1.stride == (2, 2)  # the default, reloaded
    assert not any("split" in type(mod).__name__.lower() for mod in backbone.modules())
    assert backbone(torch.zeros(2, 1, 16, 16)).shape == (2, meta["num_features"])


def test_pretrain__encoder_loads_into_torchvision_with_only_fc_missing(tmp_path):
    shards = build_tiny_shards(tmp_path / "rgb", n_pretrain=64, n_train=32, n_test=32, size=32,
                               mode="RGB")
    run_pretrain(shards, tmp_path, {"model": {"width": 64, "small_stem": False},
                                    "pretrain": {"epochs": 1, "batch_size": 32}})
    sd = torch.load(tmp_path / "encoder.pt", weights_only=True)
    res = torchvision.models.resnet18(num_classes=10).load_state_dict(sd, strict=False)
    assert sorted(res.missing_keys) == ["fc.bias", "fc.weight"]
    assert res.unexpected_keys == []
    _, meta = load_encoder(tmp_path / "encoder.pt")
    assert meta["stem_stride"] == 1  # the default 2 applies to the small stem only


def test_pretrain__nan_loss_stops_with_step_and_keeps_checkpoint(tiny_shards, tmp_path,
                                                                 monkeypatch):
    import pipeline.moco.model as model_mod

    real = model_mod.info_nce
    calls = {"n": 0}

    def poisoned(*a, **k):
        loss, logits = real(*a, **k)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] > 5 else loss), logits

    monkeypatch.setattr(model_mod, "info_nce", poisoned)
    with pytest.raises(NonFiniteLossError, match="at step 5"):
        run_pretrain(tiny_shards, tmp_path)
    ck = torch.load(tmp_path / "ckpt/last.pt", weights_only=True)
    assert ck["step"] == 4  # the last good checkpoint (every 2 steps) survives
    assert not (tmp_path / "encoder.pt").exists()


def test_pretrain__nonfinite_buffer_is_never_saved__the_good_checkpoint_stays(
        tiny_shards, tmp_path, monkeypatch, caplog):
    # bf16 at a huge lr: a BatchNorm running variance overflows while the loss (computed with
    # batch statistics in train mode) stays finite. Simulated exactly: after step 3 (index 2)
    # one running_var becomes inf. The checkpoint due after step 4 must not be written; the one
    # of step 2 (every 2 steps) stays, and the message names the tensor and that checkpoint.
    import pipeline.train.engine as engine
    from pipeline.train.checkpoint import NonFiniteError, load_checkpoint, nonfinite

    real = engine.train_step

    def overflow(net, images, **kw):
        out = real(net, images, **kw)
        if kw["step"] == 2:
            bn = next(m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d))
            bn.running_var.fill_(float("inf"))
        return out

    monkeypatch.setattr(engine, "train_step", overflow)
    with pytest.raises(NonFiniteError) as e:
        run_pretrain(tiny_shards, tmp_path)
    path = tmp_path / "ckpt/last.pt"
    assert re.search(r"^non-finite values in \S+running_var at step 4: not saved; training "
                     r"stopped, the last good checkpoint is kept at \S+ \(step 2\)\. Lower "
                     "pretrain.lr", str(e.value)), str(e.value)
    ck = torch.load(path, weights_only=True)
    assert ck["step"] == 2 and nonfinite(ck["model"]) == []
    # a checkpoint written before this check, holding an infinity, is never resumed
    ck["model"][next(k for k in ck["model"] if k.endswith("running_var"))].fill_(float("inf"))
    torch.save(ck, path)
    caplog.set_level("INFO")
    assert load_checkpoint(path, ck["fingerprint"]) is None
    assert "non-finite values in" in caplog.text and "starting fresh" in caplog.text


def test_pretrain__finished_checkpoint_reused__one_line_names_it(tiny_shards, tmp_path, caplog):
    # DVC reruns pretrain for a change outside the fingerprint (a logging cadence): the
    # finished checkpoint is reused, and one line says so
    run_pretrain(tiny_shards, tmp_path / "a")
    first = (tmp_path / "a/encoder.pt").read_bytes()
    caplog.set_level("INFO")
    run_pretrain(tiny_shards, tmp_path / "a", {"pretrain": {"log_every_steps": 4}})
    lines = [r.getMessage() for r in caplog.records if "finished training" in r.getMessage()]
    assert lines == [f"pretrain: {tmp_path / 'a/ckpt/last.pt'} is a finished training of this "
                     "fingerprint (step 24 of 24): its weights are exported again, nothing is "
                     "trained (to retrain: `python -m pipeline clean-checkpoints`)"]
    assert (tmp_path / "a/encoder.pt").read_bytes() == first


def test_pretrain__worker_death_while_a_checkpoint_is_written__names_the_one_on_disk(
        tiny_shards, tmp_path, monkeypatch):
    # PyTorch's SIGCHLD handler raises at any line: here right after the checkpoint of step 4
    # was renamed into place (one every 2 steps), before save() returns. The message must name
    # step 4, the file a rerun resumes from, not step 2, the last save that returned.
    from pipeline.data.workers import LoaderWorkerError
    from pipeline.train.checkpoint import Checkpointer

    real_save = Checkpointer.save

    def save_then_die(self, net, optimizer, scaler, state):
        real_save(self, net, optimizer, scaler, state)
        if state.step == 4:
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")

    monkeypatch.setattr(Checkpointer, "save", save_then_die)
    with pytest.raises(LoaderWorkerError) as e:
        run_pretrain(tiny_shards, tmp_path)
    assert torch.load(tmp_path / "ckpt/last.pt", weights_only=True)["step"] == 4
    assert f"the last checkpoint is at step 4 ({tmp_path / 'ckpt/last.pt'})" in str(e.value)
    assert "pid 4242" in str(e.value) and "SIGKILL" in str(e.value)


def test_checkpointer_saved_step__only_this_runs_readable_file(tiny_shards, tmp_path):
    from dataclasses import replace

    from pipeline.config import from_dict
    from pipeline.data.manifest import read_manifest
    from pipeline.train.checkpoint import Checkpointer
    from pipeline.train.training_input import training_input

    run_pretrain(tiny_shards, tmp_path, max_steps=3)  # checkpoint at step 2
    path = tmp_path / "ckpt/last.pt"
    # the key the engine computed (no data.image_size: the manifest fixes the crop)
    key = training_input(from_dict(TINY), read_manifest(tiny_shards / "pretrain"), 1)
    assert torch.load(path, weights_only=True)["fingerprint"] == key.fingerprint
    assert Checkpointer(path, key, is_main=True).saved_step() == 2
    other = replace(key, code_digest="0" * 64)
    assert Checkpointer(path, other, is_main=True).saved_step() is None
    assert Checkpointer(tmp_path / "none.pt", key, is_main=True).saved_step() is None
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    assert Checkpointer(path, key, is_main=True).saved_step() is None


def test_pretrain__resume_after_interruption_is_bit_identical(tiny_shards, tmp_path, caplog):
    run_pretrain(tiny_shards, tmp_path / "full")
    part = tmp_path / "part"
    run_pretrain(tiny_shards, part, max_steps=7)  # "crash" after step 7 (checkpoint at 6)
    ck = torch.load(part / "ckpt/last.pt", weights_only=True)
    assert ck["step"] == 6
    caplog.set_level("INFO")
    run_pretrain(tiny_shards, part)
    # a fresh start would be bit-identical too: the restart must have resumed at step 6
    assert f"resuming from {part / 'ckpt/last.pt'} at step 6" in caplog.text
    assert same_state(tmp_path / "full/encoder.pt", part / "encoder.pt")


def test_pretrain__changed_params_ignore_checkpoint(tiny_shards, tmp_path, caplog):
    run_pretrain(tiny_shards, tmp_path, max_steps=4)
    caplog.set_level("INFO")
    run_pretrain(tiny_shards, tmp_path, {"moco": {"T": 0.2}, "pretrain": {"num_workers": 1}},
                 max_steps=2)
    assert "ignoring checkpoint" in caplog.text and "starting fresh" in caplog.text
    # the log line names exactly the params that changed, old -> new
    assert ("changed: params.moco.T: 0.1 -> 0.2, params.pretrain.num_workers: 0 -> 1;"
            in caplog.text)


def test_pretrain__same_params_other_shards_explained(tmp_path, caplog):
    a = build_tiny_shards(tmp_path / "a")
    b = build_tiny_shards(tmp_path / "b", n_pretrain=208)
    run_pretrain(a, tmp_path / "out", max_steps=2)
    caplog.set_level("INFO")
    run_pretrain(b, tmp_path / "out", max_steps=2)
    # 192 -> 208 pretraining images: the data changed, no param did
    line = next(r.getMessage() for r in caplog.records if "ignoring checkpoint" in r.getMessage())
    assert "data.num_samples: 192 -> 208" in line and "params." not in line


# The tiny run in a subprocess that blocks right before the checkpoint of step `at` is written:
# SIGKILL then lands at a known point. On disk: the checkpoint of step `at - 2` (one every 2
# steps); in memory, lost with the process: 2 more optimizer steps, queue and RNG advances.
KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from helpers import run_pretrain
    from pipeline.train.checkpoint import Checkpointer
    real_save = Checkpointer.save
    def save_or_block(self, net, optimizer, scaler, state):
        if state.step == {at}:
            print("blocked", flush=True)
            time.sleep(600)  # the test SIGKILLs the process here
        real_save(self, net, optimizer, scaler, state)
    Checkpointer.save = save_or_block
    run_pretrain(Path({shards!r}), Path({out!r}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("at", [4, 16], ids=["epoch0", "epoch1"])
def test_pretrain__sigkill_then_restart_is_bit_identical(tiny_shards, tmp_path, at, caplog):
    # 12 steps per epoch: at=4 resumes inside the first epoch, at=16 inside the second (the
    # restart must rebuild epoch 1's order and skip its first 14 - 12 = 2 batches)
    run_pretrain(tiny_shards, tmp_path / "full")
    out = tmp_path / "killed"
    code = KILL_SCRIPT.format(tests=str(ROOT / "tests"), shards=str(tiny_shards), out=str(out),
                              at=at)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "blocked"
        assert proc.poll() is None  # still running: the kill interrupts a live training
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert torch.load(out / "ckpt/last.pt", weights_only=True)["step"] == at - 2
    assert not (out / "encoder.pt").exists()
    caplog.set_level("INFO")
    run_pretrain(tiny_shards, out)
    assert f"resuming from {out / 'ckpt/last.pt'} at step {at - 2}" in caplog.text
    assert same_state(tmp_path / "full/encoder.pt", out / "encoder.pt")


def _first_images(split_dir: Path, n: int) -> tuple[torch.Tensor, list[int]]:
    """The first ``n`` samples in manifest order, read with tarfile + PIL (not the loader):
    ``(n, 1, H, W)`` floats normalised with the manifest's mean and std, and the labels."""
    manifest = json.loads((split_dir / "manifest.json").read_text())
    images, labels = [], []
    for shard in manifest["shards"]:
        with tarfile.open(split_dir / shard["name"]) as tar:
            files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name in sorted(f for f in files if f.endswith(".png")):
            images.append(np.asarray(Image.open(io.BytesIO(files[name]))))
            labels.append(int(files[name[:-len(".png")] + ".cls"]))
    x = torch.tensor(np.stack(images[:n]), dtype=torch.float32)[:, None] / 255
    return (x - manifest["mean"][0]) / manifest["std"][0], labels[:n]


def test_pretrain__knn_monitor_curve(tiny_shards, tmp_path):
    m = run_pretrain(tiny_shards, tmp_path, {"pretrain": {
        "knn_every_epochs": 1, "knn_monitor_train_images": 64, "knn_monitor_test_images": 32}})
    rows = [r.split("\t") for r in (tmp_path / "knn.tsv").read_text().splitlines()]
    assert [r[:2] for r in rows] == [["epoch", "step"], ["0", "0"], ["1", "12"], ["2", "24"]]
    assert float(rows[1][2]) == m["knn_top1_init"] and float(rows[3][2]) == m["knn_top1"]
    # 4 classes, every one in the bank: the top-5 (= top-4) vote always holds the true class
    assert [float(r[3]) for r in rows[1:]] == [100.0] * 3
    # the final top-1 recomputed by hand from the exported encoder (the query backbone after the
    # last step): the first 64 train / 32 test images, cosine, k = min(200, 64) = all 64 bank
    # rows, votes exp(sim / 0.1), ties to the lowest class
    backbone, _ = load_encoder(tmp_path / "encoder.pt")
    with torch.no_grad():
        bank_x, bank_y = _first_images(tiny_shards / "train", 64)
        query_x, query_y = _first_images(tiny_shards / "test", 32)
        bank = [v / v.norm() for v in backbone.eval()(bank_x).double()]
        queries = [v / v.norm() for v in backbone(query_x).double()]
    correct = 0
    for q, y in zip(queries, query_y):
        votes = [0.0] * 4
        for b, c in zip(bank, bank_y):
            votes[c] += math.exp(float(q @ b) / 0.1)
        correct += max(range(4), key=lambda c: (votes[c], -c)) == y
    assert m["knn_top1"] == pytest.approx(100 * correct / 32)  # 78.125 (25 of 32) when written


TORCHRUN = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from helpers import run_pretrain
    m = run_pretrain(Path({shards!r}), Path({out!r}),
                     {{"moco": {{"bn": "shuffle"}}, "pretrain": {{"num_workers": 1}}}})
    Path({out!r}, f"rank{{os.environ['RANK']}}.json").write_text(json.dumps(m))
""")


@pytest.mark.slow
def test_pretrain__torchrun_two_processes_gloo(tmp_path):
    # uneven shards: 3 shards of 64, 64, 32 images for 2 ranks x 1 worker
    shards = build_tiny_shards(tmp_path / "s", n_pretrain=160, per_shard=64)
    out = tmp_path / "out"
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN.format(tests=str(ROOT / "tests"), shards=str(shards),
                                      out=str(out)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29531", str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m0 = json.loads((out / "rank0.json").read_text())
    m1 = json.loads((out / "rank1.json").read_text())
    assert m0["world_size"] == 2 and m0["steps"] == m1["steps"] == 2 * (160 // 16)
    assert m0["queue_ranks_identical"] == m1["queue_ranks_identical"] == 1
    assert (out / "encoder.pt").exists()


def test_pretrain__small_crops_resume_is_bit_identical(tiny_shards, tmp_path):
    # fp32: at this toy shape (width 4, 8 px crops, 1 thread) bf16 autocast on CPU gives NaN
    # losses at varying steps in torch 2.14 (not at the default shape; docs/performance.md)
    over = {"augment": {"small_crops": 2, "small_crop_size": 8}, "pretrain": {"precision": "fp32"}}
    run_pretrain(tiny_shards, tmp_path / "full", over)
    part = tmp_path / "part"
    run_pretrain(tiny_shards, part, over, max_steps=7)  # checkpoint at 6
    run_pretrain(tiny_shards, part, over)
    assert same_state(tmp_path / "full/encoder.pt", part / "encoder.pt")
    # and the small crops change the training (the encoder differs from the run without them)
    run_pretrain(tiny_shards, tmp_path / "none", {"pretrain": {"precision": "fp32"}})
    assert not same_state(tmp_path / "full/encoder.pt", tmp_path / "none/encoder.pt")


def test_pretrain__head_pt_loads_with_weights_only_and_embed_uses_it(tiny_shards, tmp_path):
    # embed.use_head loads head.pt with weights_only=True, which refuses any pickled class: the
    # head's kind is written as text ("mlp"), not as the params' enum member
    from pipeline.evaluate.run.embed import embed

    run_pretrain(tiny_shards, tmp_path, {"pretrain": {"epochs": 1}})
    head = torch.load(tmp_path / "head.pt", weights_only=True)
    assert type(head["kind"]) is str and head["kind"] == "mlp"
    m = embed(encoder_path=tmp_path / "encoder.pt", shards_dir=tiny_shards, out_dir=tmp_path / "f",
              batch_size=32, pool_grid=1, layer=4, use_head=True, head_path=tmp_path / "head.pt")
    assert m["dim"] == head["dim"]
