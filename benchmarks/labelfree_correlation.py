"""Do the label-free numbers rank encoders the way kNN top-1 does? Spearman over many encoders.

Trains several variants of the default recipe (``params.yaml``) for a few epochs each on the
built shards, with the monitor after every epoch: each monitor point is one encoder (the
random init, then every epoch's query backbone). For each encoder the monitor gives the kNN
top-1 (MoCo protocol on the monitor's images: k=200, T=0.1, global pool, ``pretrain.
knn_monitor_*``) and the label-free numbers on ``pretrain.labelfree_images`` pretraining images
(:mod:`pipeline.evaluate.labelfree`). A random init shared by several variants counts once
(:func:`distinct`). The script prints and writes (``--out``) every encoder's numbers and the
Spearman correlation of each label-free number, and of the instance top-1 of the last logged
training window before it, with kNN top-1::

    python benchmarks/labelfree_correlation.py --shards data/shards --epochs 3 \\
        --out results/labelfree-correlation-2026-12-06.json

Runs resume (``--work``), so a killed run continues where it stopped.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from pathlib import Path

from scipy.stats import spearmanr

# variants of the default recipe that span a range of encoder quality
VARIANTS: dict[str, dict[str, dict]] = {
    "default": {},
    "width16": {"model": {"width": 16}},
    "T0.5": {"moco": {"T": 0.5}},
    "m0.9": {"moco": {"m": 0.9}},
    "lr0.03": {"pretrain": {"lr": 0.03}},
    "multicrop2": {"augment": {"small_crops": 2}},
}
NUMBERS = ("rankme", "alignment", "uniformity", "inst_top1")


def train_variant(name: str, overrides: dict, *, params: Path, shards: Path, epochs: int,
                  work: Path) -> list[dict]:
    """One variant's encoders: a row per monitor point (kNN top-1 and the label-free numbers)."""
    from pipeline.config import from_dict, load_params, to_dict
    from pipeline.train.engine import pretrain

    tree = to_dict(load_params(params))
    for sec, vals in overrides.items():
        tree[sec].update(copy.deepcopy(vals))
    tree["pretrain"].update(epochs=epochs, knn_every_epochs=1)
    p = from_dict(tree)
    out = work / name
    pretrain(model=p.model, moco=p.moco, opt=p.pretrain, augment=p.augment, seed=p.seed,
             shards_dir=shards, encoder_path=out / "encoder.pt", checkpoint_dir=out / "ckpt",
             metrics_path=out / "metrics.json", plots_path=out / "plots.tsv",
             knn_plots_path=out / "knn.tsv")
    knn = _tsv(out / "knn.tsv")
    lf = {r["epoch"]: r for r in _tsv(out / "labelfree.tsv")}
    train = _tsv(out / "plots.tsv")
    rows = []
    for r in knn:
        before = [t for t in train if t["step"] <= r["step"]]
        rows.append({"variant": name, "epoch": int(r["epoch"]), "knn_top1": r["knn_top1"],
                     **{k: lf[r["epoch"]][k] for k in ("rankme", "alignment", "uniformity")},
                     "inst_top1": before[-1]["inst_top1"] if before else None})
    return rows


def _tsv(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    head = lines[0].split("\t")
    return [{h: float(v) if v else None for h, v in zip(head, line.split("\t"))}
            for line in lines[1:]]


def distinct(rows: list[dict]) -> list[dict]:
    """The rows of distinct encoders: a random init shared by variants is counted once.

    Variants that change neither the architecture nor the seed start from the same weights, so
    their epoch-0 rows are one encoder measured again (identical numbers); only the first is
    kept, else the sample would hold copies of one point.
    """
    seen, out = set(), []
    for r in rows:
        key = (r["knn_top1"], *(r[k] for k in ("rankme", "alignment", "uniformity")))
        if r["epoch"] == 0 and key in seen:
            continue
        seen.add(key)
        out.append(r)
    return out


def correlations(rows: list[dict]) -> dict[str, dict]:
    """Spearman rho (and p) of each number with kNN top-1, over the rows that have it."""
    out = {}
    for k in NUMBERS:
        have = [r for r in rows if r.get(k) is not None]
        rho, pval = spearmanr([r[k] for r in have], [r["knn_top1"] for r in have])
        out[k] = {"spearman_rho": round(float(rho), 4), "p_value": float(f"{pval:.3g}"),
                  "encoders": len(have)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--shards", type=Path, default=Path("data/shards"))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/labelfree-correlation"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rows, t0 = [], time.time()
    for name in args.variants.split(","):
        rows += train_variant(name, VARIANTS[name], params=args.params, shards=args.shards,
                              epochs=args.epochs, work=args.work)
        print(json.dumps(rows[-1]), flush=True)
    rows = distinct(rows)
    result = {"encoders": rows, "spearman_with_knn_top1": correlations(rows),
              "epochs_per_variant": args.epochs, "variants": args.variants.split(","),
              "wall_s": round(time.time() - t0)}
    print(json.dumps(result["spearman_with_knn_top1"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
