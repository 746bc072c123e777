"""CUDA throughput of the MoCo step: bf16 autocast + channels_last; prints JSON.

Runs the project's MoCo module (SplitBN, queue, EMA, InfoNCE) on synthetic data for
resnet18 at 32 px (CIFAR-size, small stem) and resnet50 at 224 px (ImageNet-size), reporting
images/s (median over timed steps after warm-up, synchronised). Exits 0 with a message when no
CUDA device exists.

Usage: ``python benchmarks/gpu.py [--steps 30] [--batch-r18 512] [--batch-r50 128]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from pipeline.moco.backbones import build_backbone, build_head
from pipeline.moco.model import MoCo


def bench(name: str, size: int, batch: int, small_stem: bool, steps: int, dtype: torch.dtype,
          channels_last: bool, device: torch.device) -> dict:
    torch.manual_seed(0)
    bb = build_backbone(name, width=64, in_channels=3, small_stem=small_stem)
    head = build_head("mlp", bb.num_features, bb.num_features, 128)
    net = MoCo(bb, head, K=65536, m=0.999, T=0.2, bn="split", bn_splits=8).to(device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    net = net.to(memory_format=fmt)
    opt = torch.optim.SGD(net.trainable_parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    x_q = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=fmt)
    x_k = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=fmt)
    times = []
    for step in range(steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=dtype):
            out = net(x_q, x_k, step=step)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"model": name, "image_size": size, "batch_size": batch, "dtype": str(dtype),
            "channels_last": channels_last,
            "images_per_s": round(batch / statistics.median(times[max(3, steps // 3):]), 1),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "final_loss": round(float(out.loss), 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-r18", type=int, default=512)
    ap.add_argument("--batch-r50", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: nothing to measure"}))
        return 0
    device = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "runs": []}
    for name, size, batch, small in (("resnet18", 32, args.batch_r18, True),
                                     ("resnet50", 224, args.batch_r50, False)):
        for cl in (True, False):
            results["runs"].append(bench(name, size, batch, small, args.steps, dtype, cl, device))
            print(json.dumps(results["runs"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
