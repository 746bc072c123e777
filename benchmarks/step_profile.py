"""Where a MoCo step's CPU time goes: torch.profiler over the project's MoCo module.

One cached random batch of the params' shape (no loader, no augmentation), the params'
model and MoCo settings, forward + backward + SGD; after warm-up steps the profiler records
``--steps`` steps and the self CPU time is summed into groups (convolution forward and
backward, batch norm forward and backward, the rest). Prints one JSON object: the rate without
the profiler, the shares in percent and the ten costliest ops.
Usage: ``python benchmarks/step_profile.py [--precision fp32|bf16] [--steps 20]``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pipeline.config import load_params
from pipeline.train.plan import build_moco

GROUPS = {"convolution": ("convolution",), "batch_norm": ("batch_norm",)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    p = load_params(args.params)
    size, channels, batch = p.data.image_size or 28, 1, p.pretrain.batch_size
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    torch.manual_seed(p.seed)
    net = build_moco(p.model, p.moco, in_channels=channels, image_size=size).train()
    opt = torch.optim.SGD(net.trainable_parameters(), lr=p.pretrain.lr * batch / 256,
                          momentum=p.pretrain.sgd_momentum, weight_decay=p.pretrain.weight_decay)
    x_q, x_k = (torch.randn(batch, channels, size, size) for _ in range(2))

    def step(s: int) -> None:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = net(x_q, x_k, m=p.moco.m, step=s)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()

    for s in range(10):
        step(s)
    t0 = time.perf_counter()
    for s in range(args.steps):
        step(s)
    rate = args.steps * batch / (time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(args.steps):
            step(s)
    ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(ops.values())
    shares = {g: sum(v for k, v in ops.items() if any(w in k for w in words))
              for g, words in GROUPS.items()}
    shares["rest"] = total - sum(shares.values())
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:10]
    print(json.dumps({
        "benchmark": "step_profile", "precision": args.precision, "batch": batch,
        "image_size": size, "width": p.model.width, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "images_per_s_unprofiled": round(rate, 1),
        "share_percent": {k: round(100 * v / total, 1) for k, v in shares.items()},
        "top_ops_percent": {k: round(100 * v / total, 1) for k, v in top},
    }))


if __name__ == "__main__":
    main()
