"""Time the features-mode linear probe: rows normalised once (the probe) vs in every batch.

The probe (:func:`pipeline.evaluate.linear.train_linear_on_features`) L2-normalises each fixed
feature row once; the variant normalises every batch as it is drawn, every epoch (what the
augment mode must do). Both train the same classifier on the same ``(N, D)`` random features
(same shape, fp32, same threads), after one untimed warm-up call of each, interleaved with the
order swapped every round; prints one JSON object with the per-round
seconds, their medians and the ratio. Defaults: the default run's shape (60,000 x 2,048,
batch 256, 10 classes, 10,000 test rows) for 10 epochs.
Usage: ``python benchmarks/linear_probe.py [--dim 2048] [--epochs 10] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from pipeline.evaluate import linear as lin
from pipeline.evaluate.features import FeatureSet
from pipeline.schedules import lr_schedule


def _per_batch(train: FeatureSet, test: FeatureSet, epochs: int, batch_size: int) -> None:
    """The same probe with the normalisation inside the loop (``_fit``'s ``feature_norm``)."""
    clf = lin._make_classifier(train.features.shape[1], 10, 0, torch.device("cpu"))
    lrs = lr_schedule(base_lr=30.0, batch_size=batch_size, total_steps=epochs, steps_per_epoch=1,
                      schedule="step", milestones=(60, 80))
    order = torch.Generator().manual_seed(0)
    x, y = train.features, train.labels

    def batches(epoch: int):
        perm = torch.randperm(len(y), generator=order)
        for i in range(0, len(perm), batch_size):
            yield x[perm[i:i + batch_size]], y[perm[i:i + batch_size]]

    lin._fit(clf, lambda v: v, batches, lrs=lrs, momentum=0.9, weight_decay=0.0,
             feature_norm="l2", device=torch.device("cpu"), val_batches=None,
             test_batches_each_epoch=lambda: [(test.features, test.labels)], progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=60_000)
    ap.add_argument("--test", type=int, default=10_000)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    def features(n: int) -> FeatureSet:
        return FeatureSet(torch.randn(n, args.dim, generator=g).relu(),
                          torch.randint(0, 10, (n,), generator=g), [str(i) for i in range(n)])
    train, test = features(args.n), features(args.test)
    def runs(epochs: int) -> dict[str, Callable[[], object]]:
        return {"once": lambda: lin.train_linear_on_features(
                    train, test, epochs=epochs, batch_size=args.batch_size, num_classes=10),
                "per_batch": lambda: _per_batch(train, test, epochs, args.batch_size)}

    for fn in runs(1).values():  # warm-up: allocator, oneDNN kernels, page faults
        fn()
    timed = runs(args.epochs)
    times: dict[str, list[float]] = {k: [] for k in timed}
    for r in range(args.rounds):
        for name in (list(timed) if r % 2 == 0 else list(timed)[::-1]):
            fn = timed[name]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "benchmark": "linear_probe", "n": args.n, "test": args.test, "dim": args.dim,
        "epochs": args.epochs, "batch_size": args.batch_size, "dtype": "float32",
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "seconds": {k: [round(t, 2) for t in v] for k, v in times.items()},
        "seconds_median": {k: round(v, 2) for k, v in med.items()},
        "per_batch_over_once": round(med["per_batch"] / med["once"], 2),
    }))


if __name__ == "__main__":
    main()
