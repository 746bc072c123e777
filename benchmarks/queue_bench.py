"""Cost of one enqueue into the key queue vs K (D=128, batch 256); prints JSON.

Median over repeats of the time of ``KeyQueue.enqueue`` (in-place slice writes with wrap-around)
and the queue's key memory (K*D*4 bytes).

Usage: ``python benchmarks/queue_bench.py [--Ks 4096 16384 65536] [--batch 256]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pipeline.moco.queue import KeyQueue


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--Ks", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    out = []
    for K in args.Ks:
        q = KeyQueue(args.dim, K)
        keys = torch.nn.functional.normalize(torch.randn(args.batch, args.dim), dim=1)
        times = []
        for step in range(args.repeats):
            t0 = time.perf_counter()
            q.enqueue(keys, step)
            times.append(time.perf_counter() - t0)
        out.append({"K": K, "enqueue_us": round(1e6 * statistics.median(times), 1),
                    "key_bytes": q.keys.numel() * q.keys.element_size()})
    print(json.dumps({"dim": args.dim, "batch": args.batch, "results": out}, indent=2))


if __name__ == "__main__":
    main()
