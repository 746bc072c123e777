"""MoCo step throughput by encoder width and CPU precision, on one cached batch; prints JSON.

What it answers: how much a wider encoder costs per image, and what bf16 autocast buys on this
CPU (``precision: auto`` picks bf16 only where the CPU has native bf16, AVX512_BF16 or AMX).
Each (width, precision) runs the project's own MoCo module (default ``params.yaml`` otherwise:
backbone, stem, head, K, m, T, SplitBN, batch) for ``--steps`` full steps (query forward, EMA
update, shuffled key forward, InfoNCE, backward, SGD step, enqueue) on a fixed random batch;
the figure is the median per-step rate after ``--warmup`` steps, then the median over
``--repeats`` interleaved rounds. bf16 rows are skipped (``null``) on CPUs without native bf16,
where it runs ~30x slower than fp32.

Usage: ``python benchmarks/width_precision.py [--widths 16 24 32 48] [--steps 20]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pipeline.config import load_params
from pipeline.train.engine import build_moco
from pipeline.train.runtime import cpu_has_native_bf16


def step_rate(net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
              dtype: torch.dtype | None, steps: int, warmup: int) -> float:
    """Median images/s of ``steps`` MoCo steps after ``warmup`` untimed ones."""
    opt = torch.optim.SGD(net.trainable_parameters(), lr=0.03, momentum=0.9)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = net(*batch, m=0.99, step=i)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return batch[0].shape[0] / statistics.median(times[warmup:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 24, 32, 48])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--image-size", type=int, default=28)
    ap.add_argument("--channels", type=int, default=1)
    args = ap.parse_args()
    p = load_params(args.params)
    bf16 = cpu_has_native_bf16()
    dtypes = {"fp32": None, "bf16": torch.bfloat16}
    g = torch.Generator().manual_seed(0)
    shape = (p.pretrain.batch_size, args.channels, args.image_size, args.image_size)
    batch = (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    nets = {}
    for w in args.widths:
        p.model.width = w
        nets[w] = build_moco(p.model, p.moco, in_channels=args.channels,
                             image_size=args.image_size)
    rates: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.repeats):  # interleaved, so a slow spell hits every configuration
        for w, net in nets.items():
            for name, dtype in dtypes.items():
                if name == "bf16" and not bf16:
                    continue
                rates.setdefault((w, name), []).append(
                    step_rate(net, batch, dtype, args.steps, args.warmup))
    rows = []
    base = statistics.median(rates[(args.widths[0], "fp32")])
    for w in args.widths:
        fp32 = statistics.median(rates[(w, "fp32")])
        b = statistics.median(rates[(w, "bf16")]) if (w, "bf16") in rates else None
        rows.append({"width": w, "features": 8 * w, "fp32_images_per_s": round(fp32, 1),
                     "bf16_images_per_s": round(b, 1) if b else None,
                     "bf16_speedup": round(b / fp32, 2) if b else None,
                     "fp32_cost_vs_first_width": round(base / fp32, 2)})
    print(json.dumps({"threads": torch.get_num_threads(), "native_bf16": bf16,
                      "batch": p.pretrain.batch_size, "image_size": args.image_size,
                      "stem_stride": p.model.stem_stride, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
