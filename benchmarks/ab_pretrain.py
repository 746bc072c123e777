"""A/B helper: one default-params pretraining run of the code on ``PYTHONPATH``; prints JSON.

Used for the true-epochs A/B (``results/true-epochs-ab.tsv``): check out the two commits in
git worktrees and run each with the same seed, one intra-op thread, the same shards::

    PYTHONPATH=/path/to/worktree python benchmarks/ab_pretrain.py /path/to/worktree SEED OUT \
        --shards data/shards

``OUT/knn.tsv`` holds the kNN monitor per epoch, ``OUT/result.json`` the final metrics. Runs are
resumable (``OUT/ckpt``) and deterministic for a fixed thread count, so two of them may share the
cores; only their speed suffers.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path, help="checkout whose params.yaml is used")
    ap.add_argument("seed", type=int)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shards", type=Path, default=Path("data/shards"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    import pipeline
    from pipeline.config import load_params
    from pipeline.train.engine import pretrain

    print("code:", pipeline.__file__, flush=True)
    p = load_params(args.root / "params.yaml")
    p.seed = args.seed
    if hasattr(p.pretrain, "num_threads"):  # older checkouts have no such param
        p.pretrain.num_threads = 1
    out = args.out
    t0 = time.time()
    m = pretrain(model=p.model, moco=p.moco, opt=p.pretrain, augment=p.augment, seed=p.seed,
                 shards_dir=args.shards, encoder_path=out / "encoder.pt",
                 checkpoint_dir=out / "ckpt", metrics_path=out / "metrics.json",
                 plots_path=out / "plots.tsv", knn_plots_path=out / "knn.tsv")
    m["ab_wall_s"] = time.time() - t0
    (out / "result.json").write_text(json.dumps(m, indent=1) + "\n")
    print(json.dumps(m), flush=True)


if __name__ == "__main__":
    main()
