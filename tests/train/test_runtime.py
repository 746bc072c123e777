"""Engine parts, each alone: precision, threads, switches, signals, checkpoint cadence, windows."""

import math
import os
import shutil
import signal
import time

import pytest
import torch
from helpers import run_pretrain, says

from pipeline.signals import stop_on_signals
from pipeline.train import runtime
from pipeline.train.checkpoint import CheckpointPolicy
from pipeline.train.logging import LogWindow
from pipeline.train.runtime import (
    CPU_COMPILE_MIN_IMAGES,
    Precision,
    choose_threads,
    default_threads,
    resolve_compile,
    resolve_precision,
    resolve_switch,
    setup_threads,
    thread_candidates,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_resolve_precision__auto_follows_native_bf16_on_cpu():
    assert resolve_precision("auto", CPU, native_bf16=lambda: False) is None
    assert resolve_precision("auto", CPU, native_bf16=lambda: True) is torch.bfloat16
    assert resolve_precision("fp16", CPU) is torch.float16
    assert resolve_precision("fp32", CUDA) is None


def test_resolve_switch__auto_true_false():
    assert resolve_switch("auto", cpu_default=False, device=CPU) is False
    assert resolve_switch("auto", cpu_default=True, device=CPU) is True
    assert resolve_switch("auto", cpu_default=False, device=CUDA) is True
    assert resolve_switch("false", cpu_default=True, device=CUDA) is False
    assert resolve_switch("true", cpu_default=False, device=CPU) is True


def test_precision__fp16_scales_and_steps_on_cpu():
    p = Precision(torch.float16, CPU)
    assert p.scaler.is_enabled() and p.name == "fp16"
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    before = lin.weight.detach().clone()
    for _ in range(30):  # the scaler skips overflowing steps (scale 2**16 at first) then steps
        with p.autocast():
            loss = lin(torch.ones(2, 4)).float().pow(2).mean()
        p.backward_and_step(loss, opt)
    assert not torch.equal(before, lin.weight) and p.scaler.get_scale() <= 2.0**16
    assert Precision(None, CPU).name == "fp32" and not Precision(None, CPU).scaler.is_enabled()


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16),
                                                  ("fp16", torch.float16)])
def test_pretrain__autocast_runs_with_fp32_loss(tiny_shards, tmp_path, monkeypatch, precision,
                                                dtype):
    import pipeline.moco.model as model_mod

    real, seen = model_mod.info_nce, []

    def spy(q, k, queue, T):
        loss, logits = real(q, k, queue, T)
        seen.append((q.dtype, k.dtype, logits.dtype, loss.dtype))
        return loss, logits

    monkeypatch.setattr(model_mod, "info_nce", spy)
    m = run_pretrain(tiny_shards, tmp_path, {"pretrain": {"precision": precision, "epochs": 1}})
    assert math.isfinite(m["loss"]) and m["steps"] == 192 // 16
    # every step ran its encoders under autocast (q, k in the low precision) and its logits
    # and loss in fp32
    assert seen == [(dtype, dtype, torch.float32, torch.float32)] * (192 // 16)


def test_thread_candidates__all_cores_all_minus_workers_and_half(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert thread_candidates(0) == [8, 4]
    assert thread_candidates(2) == [8, 6, 4]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert thread_candidates(1) == [2, 1]  # the worker only decodes: both are probed
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert thread_candidates(1) == [1]


def test_default_threads__the_usable_cores_shared_by_the_nodes_processes(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_threads() == 4  # torchrun --nproc_per_node 2: 4 cores each
    assert default_threads(cores=3, local_world_size=4) == 1  # never 0


def test_setup_threads__auto_never_times_anything(monkeypatch, caplog):
    # auto is the usable cores, whatever the probe would measure: a probe that makes every
    # count but 1 look slow (a busy machine) changes nothing
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    calls = []
    monkeypatch.setattr(runtime, "choose_threads", lambda c, probe: calls.append(c) or 1)
    before = torch.get_num_threads()
    net = torch.nn.Conv2d(1, 2, 3)
    try:
        kw = dict(num_workers=1, device=CPU, probe_model=net, input_shape=(2, 1, 8, 8))
        assert setup_threads(requested="auto", resumed=0, **kw) == 2 == torch.get_num_threads()
        assert calls == []
        assert setup_threads(requested="auto", resumed=1, **kw) == 1  # a resume keeps its own
        assert setup_threads(requested=3, resumed=0, **kw) == 3  # a count is used as given
        assert "checkpoint" not in caplog.text
        # a resume goes on with the count that trained it (the helper's new-user check: a
        # finished 1-thread training exported again said num_threads 2)
        assert setup_threads(requested=3, resumed=1, **kw) == 1
        says(caplog.text, "pretrain.num_threads = 3", "trained on 1 thread", "clean-checkpoints")
        assert calls == []
        assert setup_threads(requested="probe", resumed=0, **kw) == 1  # the opt-in probe
        assert calls == [[2, 1]]
    finally:
        torch.set_num_threads(before)


def test_resolve_compile__auto_on_cpu_only_for_long_runs_of_real_widths(monkeypatch):
    import torch._inductor.cpp_builder as cb

    long_run, short_run = CPU_COMPILE_MIN_IMAGES, CPU_COMPILE_MIN_IMAGES - 1
    assert resolve_compile("true", device=CPU, width=4, total_images=1) is True
    assert resolve_compile("false", device=CUDA, width=64, total_images=10**6) is False
    assert resolve_compile("auto", device=CUDA, width=4, total_images=1) is True
    assert resolve_compile("auto", device=CPU, width=4, total_images=long_run) is False
    assert resolve_compile("auto", device=CPU, width=16, total_images=short_run) is False
    monkeypatch.setattr(cb, "get_cpp_compiler", lambda: "g++")
    assert resolve_compile("auto", device=CPU, width=16, total_images=long_run) is True

    def no_compiler() -> str:
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cb, "get_cpp_compiler", no_compiler)
    assert resolve_compile("auto", device=CPU, width=16, total_images=long_run) is False


def test_choose_threads__keeps_the_faster():
    before = torch.get_num_threads()
    try:
        # a probe that is slow with 2 threads (as beside a busy process) picks 1 thread
        assert choose_threads([2, 1], lambda: time.sleep(
            0.02 if torch.get_num_threads() == 2 else 0.001)) == 1
        assert torch.get_num_threads() == 1
        assert choose_threads([2, 1], lambda: time.sleep(
            0.001 if torch.get_num_threads() == 2 else 0.02)) == 2
        # within the 20 % margin the full count stays (stable choice on a quiet machine)
        assert choose_threads([2, 1], lambda: time.sleep(
            0.02 if torch.get_num_threads() == 2 else 0.018)) == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_on_signals__flag_then_previous_handler_restored(sig):
    previous = signal.getsignal(sig)
    with stop_on_signals() as flag:
        assert not flag.raised
        os.kill(os.getpid(), sig)
        time.sleep(0.05)
        assert flag.raised and flag.signum == sig
    assert signal.getsignal(sig) is previous


def test_checkpoint_policy__due_by_hand():
    # 10 steps per epoch, every 2 epochs, every 7 steps, 35 steps in all
    p = CheckpointPolicy(every_epochs=2, every_steps=7, total_steps=35, steps_per_epoch=10)
    assert [s for s in range(1, 36) if p.due(s)] == [7, 14, 20, 21, 28, 35]
    off = CheckpointPolicy(every_epochs=1, every_steps=0, total_steps=25, steps_per_epoch=10)
    assert [s for s in range(1, 26) if off.due(s)] == [10, 20, 25]


def test_log_window__averages_by_hand():
    w = LogWindow(batch_size=8)
    w.add(loss=2.0, top1=10.0, top5=50.0, wait_s=0.0)
    w.add(loss=4.0, top1=30.0, top5=70.0, wait_s=0.0)
    r = w.row(step=20, steps_per_epoch=8, lr=0.1, m=0.99, queue_mean_age=3.0)
    assert (r["loss"], r["inst_top1"], r["inst_top5"], r["epoch"]) == (3.0, 20.0, 60.0, 2.5)
    assert r["images_per_s"] > 0 and w.n == 0


@pytest.mark.slow
def test_pretrain__compile_on_cpu_and_resume_bit_identical(tiny_shards, tmp_path, caplog):
    # width 16: at width 4 with one thread, torch 2.14's CPU convolutions in channels_last
    # (which inductor picks) corrupt memory; the same crash happens eagerly with channels_last
    over = {"model": {"width": 16}, "pretrain": {"compile": True, "epochs": 1,
                                                  "num_threads": 1}}
    full = run_pretrain(tiny_shards, tmp_path / "full", over)
    assert math.isfinite(full["loss"])
    run_pretrain(tiny_shards, tmp_path / "part", over, max_steps=5)  # checkpoint at 4
    shutil.copytree(tmp_path / "part/ckpt", tmp_path / "eager/ckpt")
    caplog.set_level("INFO")
    run_pretrain(tiny_shards, tmp_path / "part", over)
    # a fresh start would be bit-identical too: the second run must have resumed at step 4
    assert f"resuming from {tmp_path / 'part/ckpt/last.pt'} at step 4" in caplog.text
    a = torch.load(tmp_path / "full/encoder.pt", weights_only=True)
    b = torch.load(tmp_path / "part/encoder.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the compiled run's checkpoint resumes eagerly: compiling leaves the state_dict keys alone
    eager = {"model": over["model"], "pretrain": {**over["pretrain"], "compile": False}}
    assert math.isfinite(run_pretrain(tiny_shards, tmp_path / "eager", eager)["loss"])
    assert f"resuming from {tmp_path / 'eager/ckpt/last.pt'} at step 4" in caplog.text


def test_plan_error__bad_bn_mode_is_a_one_line_user_error(tiny_shards, tmp_path):
    from pipeline.cli import error_line
    from pipeline.train.plan import PlanError

    with pytest.raises(PlanError, match="moco.bn") as e:
        run_pretrain(tiny_shards, tmp_path, {"moco": {"bn": "shuffle"}})
    assert error_line(e.value).startswith("PlanError: ")  # stage_main prints this one line


@pytest.mark.gpu
def test_pretrain__cuda_device_autocast_and_cpu_loadable_outputs(tiny_shards, tmp_path,
                                                                  monkeypatch):
    # With CUDA the engine picks cuda:0 once and everything follows it; precision auto is bf16
    # where the GPU supports it, else fp16 + GradScaler. The exported files hold CPU tensors, so
    # a machine without a GPU loads them without map_location.
    import pipeline.moco.model as model_mod

    real, seen = model_mod.info_nce, []

    def spy(q, k, queue, T):
        loss, logits = real(q, k, queue, T)
        # the autocast state itself: on CUDA, F.normalize runs in fp32, so q's dtype does not say
        autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
        seen.append((q.device.type, queue.device.type, autocast, loss.dtype))
        return loss, logits

    monkeypatch.setattr(model_mod, "info_nce", spy)
    m = run_pretrain(tiny_shards, tmp_path, {"pretrain": {"epochs": 1, "compile": False}})
    low = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert seen == [("cuda", "cuda", low, torch.float32)] * (192 // 16)
    assert math.isfinite(m["loss"]) and m["peak_memory_bytes"] > 0
    encoder = torch.load(tmp_path / "encoder.pt", weights_only=True)
    head = torch.load(tmp_path / "head.pt", weights_only=True)["state_dict"]
    assert {v.device.type for v in [*encoder.values(), *head.values()]} == {"cpu"}


def test_resolve_num_workers__auto_by_device_and_cores():
    from pipeline.train.runtime import resolve_num_workers

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    # a number is that number, on any device
    assert resolve_num_workers(3, cpu) == 3 and resolve_num_workers(0, cuda) == 0
    # CUDA: the cores per training process on the node, less one for that process
    assert resolve_num_workers("auto", cuda, cores=16, local_world_size=1) == 15
    assert resolve_num_workers("auto", cuda, cores=16, local_world_size=8) == 1
    assert resolve_num_workers("auto", cuda, cores=96, local_world_size=8) == 11
    assert resolve_num_workers("auto", cuda, cores=4, local_world_size=8) == 1  # at least one
    # CPU: one worker, the training needs the cores
    assert resolve_num_workers("auto", cpu, cores=64) == 1


@pytest.mark.slow
def test_pretrain__auto_threads_same_encoder_beside_a_busy_process(tiny_shards, tmp_path):
    # pretrain.num_threads: auto is a property of the machine: beside two processes that keep
    # every core busy, the run takes the thread count of a quiet run and trains the same weights
    import hashlib
    import subprocess
    import sys

    over = {"pretrain": {"num_threads": "auto", "epochs": 1}}
    quiet = run_pretrain(tiny_shards, tmp_path / "quiet", over)
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(1.0)
        busy = run_pretrain(tiny_shards, tmp_path / "busy", over)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert quiet["num_threads"] == busy["num_threads"] == len(os.sched_getaffinity(0))
    digest = [hashlib.sha256((tmp_path / d / "encoder.pt").read_bytes()).hexdigest()
              for d in ("quiet", "busy")]
    assert digest[0] == digest[1]


def test_pretrain__runs_json_records_how_it_ran(tiny_shards, tmp_path, monkeypatch):
    # the report's provenance: what ran (the params say `auto`), also with MLflow off
    import json
    from datetime import datetime

    import torchvision

    from pipeline.config import from_dict
    from pipeline.tracking import stage_run

    monkeypatch.chdir(tmp_path)
    with stage_run("pretrain", from_dict({"mlflow": {"enabled": False}})) as r:
        run_pretrain(tiny_shards, tmp_path / "m",
                     {"pretrain": {"precision": "fp32", "num_threads": 1}}, run=r)
    ran = json.loads((tmp_path / "runs/pretrain.json").read_text())["ran"]
    assert (ran["precision"], ran["num_threads"], ran["processes"], ran["device"]) == (
        "fp32", 1, 1, "cuda" if torch.cuda.is_available() else "cpu")
    assert (ran["torch"], ran["torchvision"]) == (torch.__version__, torchvision.__version__)
    datetime.strptime(ran["finished_utc"], "%Y-%m-%d %H:%M:%S")  # raises if not that format
    assert ran["cpu"].endswith(f", {len(os.sched_getaffinity(0))} of {os.cpu_count()} cores")
