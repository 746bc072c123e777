"""Which images to label: every method at every budget, over seeds, on a finished default run.

Reads what the ``select_labels`` stage reads (``features/insights.pt`` from ``data_insights``,
``features/{train,test}.pt`` from ``embed``) in a repo where the pretraining images are the
labelled train split (the default run), and prints one JSON object per (method, seed): the picks'
top-1 for both probes and the classes they reach, per budget
(:func:`pipeline.evaluate.run.select_labels.measure`, the stage's own measurement), and the
seconds the picking took. Methods with a seed (``random``: the draw; ``typical``: k-means;
``probcover``: k-means of its radius) run once per seed; ``kcenter`` has none and runs once.

Usage: ``python benchmarks/selection_study.py --root /path/to/repo [--seeds 5]
[--methods random kcenter typical probcover] [--budgets 10 20 50 100 250]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pipeline.config import LinearParams, SelectionParams, load_params
from pipeline.evaluate.features import load_features
from pipeline.evaluate.insights import load_neighbourhoods
from pipeline.evaluate.run.select_labels import measure, pick_all


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=Path("."))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=["random", "kcenter", "typical", "probcover"])
    ap.add_argument("--budgets", nargs="+", type=int, default=[10, 20, 50, 100, 250])
    args = ap.parse_args()
    params = load_params(args.root / "params.yaml")
    linear: LinearParams = params.linear
    data = load_neighbourhoods(args.root / "features/insights.pt")
    if not data["built_is_train"]:
        raise SystemExit("the pretraining images are not the train split: nothing to measure")
    train, test = (load_features(args.root / f"features/{s}.pt") for s in ("train", "test"))
    for method in args.methods:
        for seed in range(1 if method == "kcenter" else args.seeds):
            p = SelectionParams(budget=args.budgets, method=method, compare=[method],
                                draws=1, exclude_outliers=params.selection.exclude_outliers)
            t0 = time.time()
            picks, info = pick_all(data, p, seed=seed)
            picked_s = time.time() - t0
            out = measure(picks, data["keys"], train, test, linear=linear, seed=seed,
                          device=torch.device("cpu"))[method]
            print(json.dumps({"method": method, "seed": seed, "pick_s": round(picked_s, 1),
                              "delta": info.get("probcover_delta"),
                              "top1": {b: {k: v[k]["mean"] for k in ("knn", "linear", "classes")}
                                       for b, v in out.items()}}), flush=True)


if __name__ == "__main__":
    main()
