"""Which label-free number answers which question? Full-length runs measured at every epoch.

Three questions a user without labels asks of a pretraining run, each with its own evidence:

(a) *within a run*: is it still improving, has it plateaued, did it get worse? Each candidate
    number's Spearman rho with the kNN monitor along the epochs of one run (every epoch,
    random init included), for full-length runs of several recipes;
(b) *across runs of one recipe*: which run is best? (``labelfree_correlation.py``'s encoders
    plus these runs' ends);
(c) *absolute*: has it collapsed, is it better than its random init? Encoders known by
    construction (constant output, rank-1 output, the random init, a trained one).

``train RUN`` trains one run through :func:`pipeline.train.engine.pretrain` with the monitor
after every epoch and keeps every epoch's query backbone (``WORK/RUN/epochs/epoch-NNN.pt``,
plus the monitor's kNN and label-free rows of that epoch in ``epoch-NNN.json``); the training
resumes from its checkpoint (every ``pretrain.checkpoint_every_steps``), so a killed run loses
little. ``measure RUN`` computes every candidate number of every kept epoch
(:mod:`benchmarks.labelfree_candidates`), one cached JSON per epoch. ``analyse`` writes the
study's JSON::

    python benchmarks/labelfree_study.py train default      # ~40 min on 2 busy cores
    python benchmarks/labelfree_study.py measure default
    python benchmarks/labelfree_study.py analyse --out results/labelfree-verdicts-2026-12-06.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the runs: (params file, overrides); each is trained for its file's pretrain.epochs
RUNS: dict[str, tuple[str, dict[str, dict]]] = {
    "default": ("params.yaml", {}),
    "width16": ("params.yaml", {"model": {"width": 16}}),
    "long": ("configs/fashion-mnist-long.yaml", {}),
}
WORK = Path("/tmp/labelfree-study")
log = logging.getLogger("labelfree_study")


def run_params(name: str, *, root: Path = Path("."), **pretrain: Any) -> Any:
    """The params of run ``name`` with the monitor after every epoch (``pretrain``: overrides
    of that section, None = the file's)."""
    from pipeline.config import from_dict, load_params, to_dict

    path, overrides = RUNS[name]
    tree = to_dict(load_params(root / path))
    for sec, vals in overrides.items():
        tree[sec].update(copy.deepcopy(vals))
    tree["pretrain"]["knn_every_epochs"] = 1
    tree["pretrain"].update({k: v for k, v in pretrain.items() if v is not None})
    return from_dict(tree)


def train(name: str, *, shards: Path, work: Path, epochs: int | None = None,
          steps_per_epoch: int | None = None, num_threads: int | None = None) -> Path:
    """Train run ``name``, keeping each epoch's backbone and monitor rows; returns its folder."""
    from pipeline.atomic import save_torch, write_json
    from pipeline.train import engine
    from pipeline.train.export import encoder_meta

    p = run_params(name, epochs=epochs, steps_per_epoch=steps_per_epoch,
                   num_threads=num_threads)
    out = work / name
    (out / "epochs").mkdir(parents=True, exist_ok=True)
    original = engine.record_monitor

    def record(r: Any, epoch: int, *, last: bool = False) -> None:
        original(r, epoch, last=last)
        if not r.monitor.due(epoch, last=last):
            return
        stem = out / "epochs" / f"epoch-{epoch:03d}"
        save_torch(r.net.export_backbone(), stem.with_suffix(".pt"))
        rows = {"knn": [x for x in r.state.knn_rows if x["epoch"] == epoch][-1:],
                "labelfree": [x for x in r.state.labelfree_rows if x["epoch"] == epoch][-1:],
                "train": [x for x in r.state.rows
                          if x["step"] <= epoch * r.plan.steps_per_epoch][-1:]}
        write_json(stem.with_suffix(".json"), {"epoch": epoch, **{k: v[0] if v else None
                                                                  for k, v in rows.items()}})
        write_json(out / "encoder.json", encoder_meta(
            p.model, in_channels=r.plan.spec.channels, image_size=r.plan.spec.size,
            num_features=r.net.encoder_q.backbone.num_features))

    engine.record_monitor = record
    try:
        engine.pretrain(model=p.model, moco=p.moco, opt=p.pretrain, augment=p.augment,
                        seed=p.seed, shards_dir=shards, encoder_path=out / "encoder.pt",
                        checkpoint_dir=out / "ckpt", metrics_path=out / "metrics.json",
                        plots_path=out / "plots.tsv", knn_plots_path=out / "knn.tsv")
    finally:
        engine.record_monitor = original
    return out


def _candidates(name: str, shards: Path, **sizes: int) -> Any:
    from benchmarks.labelfree_candidates import Candidates
    from pipeline.data.manifest import read_manifest
    from pipeline.data.shards import image_spec

    p = run_params(name)
    spec = image_spec(read_manifest(shards / "pretrain"), shards / "pretrain")
    return Candidates(shards / "pretrain", side=spec.size, mean=spec.mean, std=spec.std,
                      preset=str(p.augment.preset), crop_min_scale=p.augment.crop_min_scale,
                      **sizes)


def measure(name: str, *, shards: Path, work: Path, **sizes: int) -> list[dict]:
    """Every candidate number of every kept epoch of run ``name`` (cached per epoch)."""
    from pipeline.atomic import write_json
    from pipeline.evaluate.run.embed import build_encoder

    out = work / name
    meta = json.loads((out / "encoder.json").read_text())
    cands, rows = None, []
    for pt in sorted((out / "epochs").glob("epoch-*.pt")):
        cached = pt.with_suffix(".cand.json")
        if not cached.exists():
            cands = cands or _candidates(name, shards, **sizes)
            t0 = time.time()
            net, _ = build_encoder(torch_load(pt), meta)
            write_json(cached, {**cands(net), "measure_s": round(time.time() - t0, 1)})
        monitor = json.loads(pt.with_suffix(".json").read_text())
        row = {"run": name, "epoch": monitor["epoch"],
               "knn_top1": (monitor["knn"] or {}).get("knn_top1"),
               "inst_top1": (monitor["train"] or {}).get("inst_top1"),
               "loss": (monitor["train"] or {}).get("loss"),
               **json.loads(cached.read_text())}
        rows.append(row)
        log.info("%s", json.dumps(row))
    return rows


def torch_load(path: Path) -> Any:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("train", "measure", "analyse"))
    ap.add_argument("runs", nargs="*")
    ap.add_argument("--shards", type=Path, default=Path("data/shards"))
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--epochs", type=int, help="override the run's pretrain.epochs (tests)")
    ap.add_argument("--steps-per-epoch", type=int, help="override (tests)")
    ap.add_argument("--threads", type=int, help="pretrain.num_threads (a busy machine: 1)")
    ap.add_argument("--n-rank", type=int, help="images of the large RankMe (tests)")
    ap.add_argument("--n-views", type=int, help="images of the view numbers (tests)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.time()
    if args.command == "train":
        for name in args.runs or list(RUNS):
            train(name, shards=args.shards, work=args.work, epochs=args.epochs,
                  steps_per_epoch=args.steps_per_epoch, num_threads=args.threads)
            print(json.dumps({"run": name, "wall_s": round(time.time() - t0)}), flush=True)
    elif args.command == "measure":
        import torch

        torch.set_num_threads(args.threads or 1)  # 2 shared, busy cores: 1 thread is faster
        sizes = {k: v for k, v in (("n_rank", args.n_rank), ("n_views", args.n_views))
                 if v is not None}
        for name in args.runs or list(RUNS):
            measure(name, shards=args.shards, work=args.work, **sizes)


if __name__ == "__main__":
    main()
