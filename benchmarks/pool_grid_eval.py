"""kNN and linear probe of one trained encoder under several ``embed.pool_grid`` layouts.

What it answers: how much of a trained encoder's quality global average pooling throws away.
For each grid ``g`` it embeds the labelled train/test shards with the last stage pooled to
``g x g`` cells (:func:`pipeline.evaluate.run.embed`), then runs the pipeline's own kNN
(``knn.select: val``: k and T chosen on 10 % of TRAIN) and linear probe (the params' protocol)
twice: with ``--val-fraction`` of TRAIN held out (the number to choose on) and on all of TRAIN
(the test number the stage reports). Prints one JSON line per grid. Deterministic for a given
machine; nothing here chooses on test.

Usage: ``python benchmarks/pool_grid_eval.py [--encoder models/encoder.pt] [--grids 1 2]``
(about 2 min per grid for Fashion-MNIST at width 32 on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pipeline.config import KnnParams, LinearMode, load_params
from pipeline.evaluate.run.embed import embed
from pipeline.evaluate.run.knn import knn_eval
from pipeline.evaluate.run.linear import linear_probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoder", type=Path, default=Path("models/encoder.pt"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--grids", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--val-fraction", type=float, default=0.1)
    args = ap.parse_args()
    p = load_params(args.params)
    shards = Path(p.data.shards_dir)
    with tempfile.TemporaryDirectory() as tmp:
        for g in args.grids:
            out = Path(tmp) / f"grid{g}"
            emb = embed(encoder_path=args.encoder, shards_dir=shards, out_dir=out,
                        batch_size=p.embed.batch_size, pool_grid=g)
            knn = knn_eval(features_dir=out, manifest_dir=shards / "test",
                           knn=KnnParams(select="val", chunk_size=p.knn.chunk_size),
                           details_path=out / "knn.json", seed=p.seed)
            row = {"pool_grid": g, "dim": emb["dim"], "knn_top1": knn["top1"], "knn_k": knn["k"],
                   "knn_T": knn["T"], "knn_val_top1": round(knn["select_val_top1"], 2)}
            for vf in (args.val_fraction, 0.0):
                lin = linear_probe(features_dir=out, shards_dir=shards, encoder_path=args.encoder,
                                   linear=p.linear.model_copy(update={
                                       "mode": LinearMode.features, "val_fraction": vf}),
                                   seed=p.seed, details_path=out / "lin.json",
                                   plots_path=out / "lin.tsv", pool_grid=g)
                if vf > 0:
                    row["linear_val_top1"] = round(lin["val_top1"], 2)
                else:
                    row["linear_top1"] = round(lin["top1"], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
