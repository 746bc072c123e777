"""Time weighted kNN (k=200, T=0.1) of a 10,000-image test set against a 60,000-image bank.

Prints one JSON object: sizes, threads, the three timings and their median in seconds.
Target on a 2-core CPU: median <= 10 s. Usage: ``python benchmarks/knn_bench.py [--device cuda]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pipeline.evaluate.knn import knn_predict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bank", type=int, default=60_000)
    ap.add_argument("--test", type=int, default=10_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--k", type=int, default=200)
    ap.add_argument("--T", type=float, default=0.1)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--bank-chunk-size", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    device = torch.device(args.device)
    bank = torch.randn(args.bank, args.dim, generator=g).to(device)
    labels = torch.randint(0, args.classes, (args.bank,), generator=g).to(device)
    test = torch.randn(args.test, args.dim, generator=g).to(device)

    times = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        knn_predict(bank, labels, test, k=args.k, T=args.T, chunk_size=args.chunk_size,
                    bank_chunk_size=args.bank_chunk_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)

    print(json.dumps({
        "benchmark": "knn_predict",
        "bank": args.bank, "test": args.test, "dim": args.dim, "classes": args.classes,
        "k": args.k, "T": args.T, "chunk_size": args.chunk_size,
        "bank_chunk_size": args.bank_chunk_size, "device": str(device),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "seconds": [round(t, 3) for t in times],
        "seconds_median": round(statistics.median(times), 3),
        "target_seconds": 10.0,
    }))


if __name__ == "__main__":
    main()
