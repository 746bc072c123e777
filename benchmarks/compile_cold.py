"""Cold ``torch.compile`` of the MoCo encoders on CPU, by SplitBatchNorm2d form; prints JSON.

What it answers: what a first compiled training step costs on a machine with no inductor cache
(a fresh clone in CI, a new cloud machine), and whether the form of SplitBatchNorm2d that
compiled code traces decides it. Forms:

* ``grouped``: what compiled code runs (``SplitBatchNorm2d._grouped_stats``: ``var_mean`` over
  the batch split into ``(N/S, S, C, H, W)``);
* ``merged``: the eager form traced instead (``F.batch_norm`` over groups merged into channels,
  ``(N/S, S*C, H, W)``), what compiled code ran before;
* ``plain``: ``moco.bn: none`` (``nn.BatchNorm2d``), the floor.

Each form runs in its own process with an empty ``TMPDIR`` (so an empty inductor cache and no
precompiled header), builds the project's MoCo module (default: the compile test's model in
``tests/train/test_runtime.py``: ResNet-18 width 16, 16 px grey, batch 16, 2 splits, one
thread, deterministic algorithms as ``pretrain.deterministic`` defaults to), compiles its two
encoders as the engine does (``wrap_model``) and times the first MoCo step (query forward,
key forward, backward, SGD: the compile), then the median of ``--steps`` more.
``cpu_s`` is the process's CPU time with its children (the C++ compiler), import included:
on a shared machine it is steadier than wall time.

Usage: ``python benchmarks/compile_cold.py [--forms grouped merged plain] [--width 16]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def child(form: str, width: int, size: int, batch: int, steps: int) -> None:
    """One form, in this (fresh) process: print the first step's and later steps' seconds."""
    import torch

    from pipeline.config import MocoParams, ModelParams
    from pipeline.train.plan import build_moco
    from pipeline.train.runtime import Runtime, configure_determinism, wrap_model

    torch.set_num_threads(1)
    configure_determinism(True, torch.device("cpu"))  # pretrain.deterministic's default
    if form == "merged":  # trace the eager form: what compiled code ran before _grouped_stats
        torch.compiler.is_compiling = lambda: False
    torch.manual_seed(0)
    net = build_moco(ModelParams(width=width, head_hidden=16, dim=8),
                     MocoParams(K=40, bn="none" if form == "plain" else "split"),
                     in_channels=1, image_size=size)
    net = wrap_model(net, Runtime(torch.device("cpu"), 0, 1, 0), channels_last=False,
                     compile_=True).train()
    opt = torch.optim.SGD(net.trainable_parameters(), lr=0.03, momentum=0.9)
    im_q, im_k = torch.randn(batch, 1, size, size), torch.randn(batch, 1, size, size)
    times = []
    for i in range(1 + steps):  # the engine's step: both encoders, the loss, SGD
        t0 = time.perf_counter()
        out = net(im_q, im_k, m=0.99, step=i)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"first_step_s": times[0], "step_s": statistics.median(times[1:])}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--forms", nargs="+", default=["grouped", "merged", "plain"],
                    choices=["grouped", "merged", "plain"])
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.width, a.size, a.batch, a.steps)
        return
    out = {"config": {"width": a.width, "size": a.size, "batch": a.batch, "threads": 1,
                      "cpus": os.cpu_count()}, "forms": {}}
    for form in a.forms:
        with tempfile.TemporaryDirectory() as tmp:
            env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
            env.update(TMPDIR=tmp, TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, __file__, "--child", form, "--width", str(a.width),
                 "--size", str(a.size), "--batch", str(a.batch), "--steps", str(a.steps)],
                env=env, capture_output=True, text=True, check=True)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        out["forms"][form] = {"process_wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                              "first_step_s": round(res["first_step_s"], 1),
                              "step_ms": round(1000 * res["step_s"], 1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
