"""Pretrain step throughput: our engine vs a minimal plain-PyTorch MoCo loop; prints JSON.

Both run the same math on the same cached batch (default params.yaml: backbone, width, head,
K, m, T, SplitBN groups, batch): query forward, EMA update, shuffled key forward, InfoNCE
against the queue, backward, SGD step, enqueue. The engine is ``pipeline.train.pretrain`` itself
with its loader replaced by the cached batch (so logging, schedules and bookkeeping count);
the reference is a 30-line loop written here without any of the project's MoCo code. Figures
are medians over ``--repeats`` interleaved runs of each run's median per-step rate over
``--steps`` steps (the first 5 steps of each run are warm-up).

Also measures the engine with the REAL loader and on-device views, as the pretrain stage runs
(images/s, its ratio to the reference, data-wait fraction), and the same beside one busy
competing process (a pure-Python spin loop), as a ratio to the quiet rate measured in this run.
The engine's thread count is re-probed at start, as in the stage.

Usage: ``python benchmarks/pretrain_step.py [--steps 20] [--repeats 3] [--params params.yaml]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import pipeline.train.engine as engine
from pipeline.config import load_params
from pipeline.data.loader import read_manifest
from pipeline.moco.backbones import build_backbone, build_head, resolve_small_stem
from pipeline.moco.batchnorm import convert_split_bn
from pipeline.train.runtime import resolve_compile, usable_cores

THREADS = torch.get_num_threads()  # the reference uses all threads; the engine probes


def cached_batch(p, size: int, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (p.pretrain.batch_size, channels, size, size)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def cached_uint8(p, size: int, channels: int) -> tuple[torch.Tensor, list[str]]:
    g = torch.Generator().manual_seed(0)
    shape = (p.pretrain.batch_size, channels, size, size)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8), [""] * shape[0]


def engine_rate(p, shards: Path, batch, steps: int, real_loader: bool = False,
                compile_: str = "auto") -> dict:
    """images/s (median of logged windows after the first) of pipeline.train.pretrain."""
    p.pretrain.steps_per_epoch = steps
    p.pretrain.epochs = 1
    p.pretrain.knn_every_epochs = 0
    p.pretrain.checkpoint_every_steps = 0
    p.pretrain.log_every_steps = 1  # one row per step: per-step rates, like the reference
    p.pretrain.compile = compile_
    original = engine.train_loader
    if not real_loader:
        engine.train_loader = lambda *a, steps, skip_batches=0, **k: (
            batch for _ in range(steps - skip_batches))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            t0 = time.perf_counter()
            engine.pretrain(model=p.model, moco=p.moco, opt=p.pretrain, augment=p.augment,
                            seed=p.seed, shards_dir=shards, encoder_path=out / "e.pt",
                            checkpoint_dir=out / "ck", metrics_path=out / "m.json",
                            plots_path=out / "p.tsv", knn_plots_path=out / "k.tsv")
            wall = time.perf_counter() - t0
            rows = [line.split("\t") for line in (out / "p.tsv").read_text().splitlines()]
    finally:
        engine.train_loader = original
    head = rows[0]
    vals = [dict(zip(head, r)) for r in rows[6:]]  # drop the header and 5 warm-up steps
    torch.set_num_threads(THREADS)
    rate = statistics.median(float(v["images_per_s"]) for v in vals)
    return {"images_per_s": rate, "wall_s": wall,
            "overhead_s": wall - steps * p.pretrain.batch_size / rate,
            "data_wait_fraction": statistics.median(float(v["data_wait_fraction"])
                                                    for v in vals)}


def reference_rate(p, batch, steps: int, channels: int, size: int) -> float:
    """A minimal MoCo loop in plain PyTorch on the same batch; images/s after 5 warm-up steps."""
    torch.set_num_threads(THREADS)
    torch.manual_seed(p.seed)
    bb = build_backbone(p.model.backbone, width=p.model.width, in_channels=channels,
                        small_stem=resolve_small_stem(p.model.small_stem, size),
                        stem_stride=p.model.stem_stride)
    q_enc = torch.nn.Sequential(bb, build_head(p.model.head, bb.num_features,
                                               p.model.head_hidden, p.model.dim))
    convert_split_bn(q_enc, p.moco.bn_splits)
    k_enc = __import__("copy").deepcopy(q_enc).requires_grad_(False)
    queue = F.normalize(torch.randn(p.model.dim, p.moco.K), dim=0)
    ptr = 0
    lr = p.pretrain.lr * p.pretrain.batch_size / 256
    opt = torch.optim.SGD(q_enc.parameters(), lr=lr, momentum=0.9,
                          weight_decay=p.pretrain.weight_decay)
    x_q, x_k = batch
    n = x_q.shape[0]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        q = F.normalize(q_enc(x_q), dim=1)
        with torch.no_grad():
            for pk, pq in zip(k_enc.parameters(), q_enc.parameters()):
                pk.mul_(p.moco.m).add_(pq.detach(), alpha=1 - p.moco.m)
            perm = torch.randperm(n)
            k = F.normalize(k_enc(x_k[perm]), dim=1)[torch.argsort(perm)]
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue], 1) / p.moco.T
        loss = F.cross_entropy(logits, torch.zeros(n, dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            idx = (ptr + torch.arange(n)) % p.moco.K
            queue[:, idx] = k.T
            ptr = (ptr + n) % p.moco.K
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times[5:])


def stage_compile(p, manifest: dict) -> str:
    """``true``/``false``: what ``pretrain.compile`` resolves to for the FULL default run on CPU
    (the benchmark's short runs would otherwise fall under the auto rule's minimum length)."""
    total = p.pretrain.epochs * (manifest["num_samples"] // p.pretrain.batch_size)
    on = resolve_compile(p.pretrain.compile, device=torch.device("cpu"), width=p.model.width,
                         total_images=total * p.pretrain.batch_size)
    return "true" if on else "false"


def amortised(r: dict, total_images: int) -> float:
    """images/s over a whole default run, counting the one-off start-up (probe, compile)."""
    return total_images / (total_images / r["images_per_s"] + r["overhead_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--shards", default=None, help="default: data.shards_dir of the params")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true",
                    help="also measure the other compile setting (eager if the default compiles)")
    args = ap.parse_args()
    p = load_params(args.params)
    shards = Path(args.shards or p.data.shards_dir)
    m = read_manifest(shards / "pretrain")
    channels, size = m["image_shape"][0], m["image_shape"][1]
    total_images = p.pretrain.epochs * (m["num_samples"] // p.pretrain.batch_size) \
        * p.pretrain.batch_size
    comp = stage_compile(p, m)
    batch = cached_batch(p, size, channels)

    def stage(**over):  # the engine with the real loader, default params + overrides
        q = load_params(args.params)
        for k, v in over.items():
            setattr(q.pretrain, k, v)
        return engine_rate(q, shards, None, args.steps, real_loader=True,
                           compile_=over.get("compile", comp))

    # a cold compile cache, as on a fresh machine: the first engine run's start-up shows its cost
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-")
    eng, ref, real = [], [], []
    for _ in range(args.repeats):  # interleaved, so background load hits all alike
        eng.append(engine_rate(load_params(args.params), shards, cached_uint8(p, size, channels),
                               args.steps, compile_=comp))
        ref.append(reference_rate(p, batch, args.steps, channels, size))
        real.append(stage())
    # the previous default layout: one thread per loader worker taken from the model, eager
    previous = stage(num_threads=max(1, usable_cores() - p.pretrain.num_workers),
                     compile="false")
    other = stage(compile="false" if comp == "true" else "true") if args.compile else None
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(2)
        busy = stage()
    finally:
        spin.kill()
        spin.wait()
    e, r = statistics.median(x["images_per_s"] for x in eng), statistics.median(ref)
    q = statistics.median(x["images_per_s"] for x in real)
    quiet = min(real, key=lambda x: abs(x["images_per_s"] - q))
    wait = statistics.median(x["data_wait_fraction"] for x in real)
    print(json.dumps({
        "config": {"backbone": p.model.backbone, "width": p.model.width, "K": p.moco.K,
                   "batch_size": p.pretrain.batch_size, "image_size": size,
                   "reference_threads": THREADS, "compile": comp},
        "engine_images_per_s": round(e, 1), "reference_images_per_s": round(r, 1),
        "engine_over_reference": round(e / r, 3),
        "engine_first_start_up_s": round(eng[0]["overhead_s"], 1),
        "engine_later_start_up_s": round(eng[-1]["overhead_s"], 1),
        "real_loader_images_per_s": round(q, 1),
        "real_loader_over_reference": round(q / r, 3),
        "real_loader_start_up_s": round(quiet["overhead_s"], 1),
        "real_loader_default_run_images_per_s": round(amortised(quiet, total_images), 1),
        "real_loader_data_wait_fraction": round(wait, 3),
        "previous_layout_images_per_s": round(previous["images_per_s"], 1),
        "real_loader_over_previous_layout": round(q / previous["images_per_s"], 3),
        "contended_images_per_s": round(busy["images_per_s"], 1),
        "contended_over_quiet": round(busy["images_per_s"] / q, 3),
        **({f"compile_{other_name(comp)}_images_per_s": round(other["images_per_s"], 1),
            f"compile_{other_name(comp)}_start_up_s": round(other["overhead_s"], 1),
            f"compile_{other_name(comp)}_default_run_images_per_s":
                round(amortised(other, total_images), 1)} if other else {}),
    }, indent=2))


def other_name(comp: str) -> str:
    return "false" if comp == "true" else "true"


if __name__ == "__main__":
    main()
