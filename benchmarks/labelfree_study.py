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
    # one-epoch runs of two variants that the cross-run study found near or below their random
    # init by kNN (m0.9) or by RankMe (multicrop2): for question (c)
    "m0.9-1ep": ("params.yaml", {"moco": {"m": 0.9}, "pretrain": {"epochs": 1}}),
    "multicrop2-1ep": ("params.yaml", {"augment": {"small_crops": 2}, "pretrain": {"epochs": 1}}),
    # the two 3-epoch runs of the cross-run study whose RankMe ended below their random init's
    # while their kNN monitor ended above it: RankMe or view top-1 for "better than random init"
    "m0.9-3ep": ("params.yaml", {"moco": {"m": 0.9}, "pretrain": {"epochs": 3}}),
    "multicrop2-3ep": ("params.yaml", {"augment": {"small_crops": 2}, "pretrain": {"epochs": 3}}),
}
WORK = Path("/tmp/labelfree-study")
log = logging.getLogger("labelfree_study")


def run_params(name: str, *, root: Path = Path("."), **pretrain: Any) -> Any:
    """The params of run ``name`` with the monitor after every epoch (``pretrain``: overrides
    of that section, None = the file's)."""
    import yaml

    from pipeline.config import from_dict

    path, overrides = RUNS[name]
    # the file's own tree: to_dict(load_params(...)) turns `compile: false` into the string
    # 'false', which from_dict refuses
    tree = yaml.safe_load((root / path).read_text())
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
    if not (out / "encoder.json").exists():
        return []  # not started yet
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


class Projected:
    """A backbone whose features are projected onto their top ``rank`` right singular vectors
    (fitted on ``sample``, uncentred): an encoder whose output has rank exactly ``rank``;
    ``rank`` 0 = a constant output (the sample's mean feature)."""

    def __new__(cls, backbone: Any, sample: Any, rank: int) -> Any:
        import torch
        from torch import nn

        class _P(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.backbone = backbone
                with torch.no_grad():
                    f = backbone.eval()(sample).double()
                basis = torch.linalg.svd(f, full_matrices=False).Vh[:rank]  # (rank, D)
                self.register_buffer("mu", f.mean(dim=0).float())
                self.register_buffer("basis", basis.float())

            def forward(self, x: Any) -> Any:
                if rank == 0:
                    return self.mu.expand(x.shape[0], -1)
                return (self.backbone(x) @ self.basis.T) @ self.basis

        return _P()


def known(run: str, *, shards: Path, work: Path, **sizes: int) -> list[dict]:
    """Encoders known by construction, from run ``run``'s kept epochs: its last epoch (trained),
    that encoder projected to rank 4 and rank 1, a constant output, its random init."""
    from pipeline.atomic import write_json
    from pipeline.data.views import build_eval_transform
    from pipeline.evaluate.run.embed import build_encoder
    from pipeline.train.monitor import KnnMonitor

    out = work / run
    meta = json.loads((out / "encoder.json").read_text())
    pts = sorted((out / "epochs").glob("epoch-*.pt"))
    cands = _candidates(run, shards, **sizes)
    p = run_params(run)
    from pipeline.data.manifest import read_manifest
    from pipeline.data.shards import image_spec

    spec = image_spec(read_manifest(shards / "pretrain"), shards / "pretrain")
    knn = KnnMonitor(shards, transform=build_eval_transform(spec.size, spec.mean, spec.std),
                     device=torch_device(), n_train=p.pretrain.knn_monitor_train_images,
                     n_test=p.pretrain.knn_monitor_test_images)
    sample = (cands.images[:2048].float() / 255 - cands.mean) / cands.std
    trained = build_encoder(torch_load(pts[-1]), meta)[0].eval()
    encoders = {"trained": lambda: trained,
                "rank4": lambda: Projected(trained, sample, 4),
                "rank1": lambda: Projected(trained, sample, 1),
                "constant": lambda: Projected(trained, sample, 0),
                "random_init": lambda: build_encoder(torch_load(pts[0]), meta)[0]}
    rows = []
    for name, make in encoders.items():
        cached = out / f"known-{name}.json"
        if not cached.exists():
            net = make().eval()
            write_json(cached, {"encoder": name, **knn(net), **cands(net)})
        rows.append({"run": run, **json.loads(cached.read_text())})
        log.info("%s", json.dumps(rows[-1]))
    return rows


# each candidate's direction (+1: higher = better); kNN top-1 is the reference
DIRECTION = {"knn_top1": 1, "rankme_2048": 1, "rankme_25600": 1, "alignment": -1,
             "uniformity": -1, "view_top1_2048": 1, "view_top1_512": 1, "lidar": 1,
             "kmeans_silhouette": 1, "kmeans_view_agreement": 1, "inst_top1": 1, "loss": -1}
OLD_STUDY = Path("results/labelfree-correlation-2026-12-06.json")


def within_run(rows: list[dict], numbers: Any = None) -> dict[str, dict]:
    """Per candidate (``numbers``, default :data:`DIRECTION`'s): Spearman rho with kNN top-1
    along the run's epochs, all of them and without the random init (epoch 0)."""
    from scipy.stats import spearmanr

    out = {}
    for k in DIRECTION if numbers is None else numbers:
        if k == "knn_top1":
            continue
        res = {}
        for label, rs in (("all_epochs", rows), ("trained_epochs", rows[1:])):
            have = [r for r in rs if r.get(k) is not None and r.get("knn_top1") is not None]
            if len(have) >= 3:
                rho, pval = spearmanr([r[k] for r in have], [r["knn_top1"] for r in have])
                res[label] = {"rho": round(float(rho), 4), "p": float(f"{pval:.3g}"),
                              "points": len(have)}
        if res:
            out[k] = res
    return out


def trend_verdicts(rows: list[dict], fractions: tuple[float, ...] = (0.05, 0.1, 0.2)
                   ) -> dict[str, dict]:
    """Per candidate and tolerance: its within-run verdict (:func:`pipeline.evaluate.verdict.
    trend`), beside kNN top-1's own at the same tolerance."""
    from pipeline.evaluate.verdict import describe, trend

    out: dict[str, dict] = {}
    for k, sign in DIRECTION.items():
        have = [r for r in rows if r.get(k) is not None]
        if len(have) < 3 or have[0]["epoch"] != 0:
            continue
        out[k] = {str(f): describe(*trend([r["epoch"] for r in have], [r[k] for r in have],
                                          higher_is_better=sign > 0, fraction=f))
                  for f in fractions}
    return out


def old_runs() -> dict[str, list[dict]]:
    """The 3-epoch runs of the cross-run study, per variant (epoch 0 = the shared init)."""
    enc = json.loads(OLD_STUDY.read_text())["encoders"]
    inits = {r["variant"]: r for r in enc if r["epoch"] == 0}
    runs: dict[str, list[dict]] = {}
    for r in enc:
        runs.setdefault(r["variant"], []).append(r)
    for rs in runs.values():
        if rs[0]["epoch"] != 0:  # shares the default width's init
            rs.insert(0, inits["default"])
    return {k: [{**r, "rankme_2048": r["rankme"]} for r in v] for k, v in runs.items()}


def analyse(work: Path, runs: list[str]) -> dict:
    """The study's JSON: per run its rows, within-run rho and verdicts; across-run rho over
    the cross-run study's encoders plus these runs' ends; the known encoders."""
    from scipy.stats import spearmanr

    result: dict[str, Any] = {"runs": {}, "short_runs": {}, "known": []}
    for name in runs:
        rows = [json.loads(f.read_text()) | {"epoch": int(f.name[6:9])}
                for f in sorted((work / name / "epochs").glob("epoch-*.cand.json"))]
        monitor = {int(f.name[6:9]): json.loads(f.read_text())
                   for f in sorted((work / name / "epochs").glob("epoch-???.json"))}
        for r in rows:
            m = monitor[r["epoch"]]
            r.update(knn_top1=(m["knn"] or {}).get("knn_top1"),
                     inst_top1=(m["train"] or {}).get("inst_top1"),
                     loss=(m["train"] or {}).get("loss"))
        result["runs"][name] = {"epochs_measured": len(rows), "rows": rows,
                                "within_run_spearman": within_run(rows),
                                "verdicts": trend_verdicts(rows)}
        result["known"] += [{"run": name, **json.loads(f.read_text())}
                            for f in sorted((work / name).glob("known-*.json"))]
    for name, rows in old_runs().items():
        result["short_runs"][name] = {"within_run_spearman": within_run(rows),
                                      "verdicts": trend_verdicts(rows)}
    old = [r | {"rankme_2048": r["rankme"]} for r in json.loads(OLD_STUDY.read_text())["encoders"]]
    ends = [v["rows"][-1] for v in result["runs"].values() if v["rows"]]
    across = {}
    for k in ("rankme_2048", "alignment", "uniformity"):
        pts = [(r[k], r["knn_top1"]) for r in old + ends if r.get(k) is not None]
        rho, pval = spearmanr(*zip(*pts))
        across[k] = {"rho": round(float(rho), 4), "p": float(f"{pval:.3g}"), "encoders": len(pts)}
    result["across_runs_spearman"] = across
    # every trained epoch of these runs as one pool of encoders (all candidates): which number
    # ranks encoders of different runs and lengths as kNN does
    pool = [r for v in result["runs"].values() for r in v["rows"][1:]]
    result["pooled_trained_spearman"] = within_run([{}] + pool)
    return result


MONITOR_NUMBERS = {"rankme": 1, "view_top1": 1, "uniformity": -1, "alignment": -1}


def read_monitor(folder: Path) -> list[dict]:
    """The monitor rows of one run, kNN and label-free joined by epoch: a pipeline run's
    ``plots/{knn_monitor,labelfree}.tsv`` or a study run's ``{knn,labelfree}.tsv``."""
    import csv

    def rows(name: str) -> dict[int, dict]:
        with open(folder / name, newline="") as f:
            return {int(r["epoch"]): {k: float(v) for k, v in r.items() if v not in ("", None)}
                    for r in csv.DictReader(f, delimiter="\t")}

    knn_file = "knn_monitor.tsv" if (folder / "knn_monitor.tsv").exists() else "knn.tsv"
    knn, free = rows(knn_file), rows("labelfree.tsv")
    return [{**free[e], **knn[e], "epoch": e} for e in sorted(knn) if e in free]


def monitor_study(folders: dict[str, Path]) -> dict:
    """Per run folder, from its monitor rows alone: :func:`_study_of_rows`."""
    return {name: _study_of_rows(str(folder), read_monitor(folder))
            for name, folder in folders.items()}


def _study_of_rows(source: str, rows: list[dict]) -> dict:
    """One run's monitor rows (every epoch, random init first): each number's Spearman rho
    with the kNN monitor, the trend verdict each number would give beside kNN's own, and the
    absolute question: is the end above the random init, by each number?"""
    from pipeline.evaluate.verdict import PLATEAU_FRACTION, describe, trend

    within = within_run(rows, MONITOR_NUMBERS)
    verdicts = {}
    for k, sign in {"knn_top1": 1, **MONITOR_NUMBERS}.items():
        have = [r for r in rows if k in r]
        if len(have) >= 2 and have[0]["epoch"] == 0:
            verdicts[k] = describe(*trend([r["epoch"] for r in have], [r[k] for r in have],
                                          higher_is_better=sign > 0, fraction=PLATEAU_FRACTION))
    init, end = rows[0], rows[-1]
    above = {k: (end[k] - init[k]) * sign > 0
             for k, sign in {"knn_top1": 1, **MONITOR_NUMBERS}.items() if k in init and k in end}
    return {"source": source, "epochs": [r["epoch"] for r in rows], "rows": rows,
            "within_run_spearman": within, "verdicts": verdicts, "end_above_init": above}


def probe_kept_epochs(name: str, *, shards: Path, work: Path) -> list[dict]:
    """The monitor's own label-free numbers (:class:`pipeline.train.monitor.LabelFreeProbe`) of
    every kept epoch of study run ``name``, with that epoch's kNN monitor (cached per epoch)."""
    from pipeline.atomic import write_json
    from pipeline.data.manifest import read_manifest
    from pipeline.data.shards import image_spec
    from pipeline.evaluate.run.embed import build_encoder
    from pipeline.train.monitor import LabelFreeProbe

    out, p = work / name, run_params(name)
    meta = json.loads((out / "encoder.json").read_text())
    spec = image_spec(read_manifest(shards / "pretrain"), shards / "pretrain")
    probe, rows = None, []
    for pt in sorted((out / "epochs").glob("epoch-*.pt")):
        cached = pt.with_suffix(".probe.json")
        if not cached.exists():
            probe = probe or LabelFreeProbe(
                shards / "pretrain", image_size=spec.size, mean=spec.mean, std=spec.std,
                preset=str(p.augment.preset), crop_min_scale=p.augment.crop_min_scale,
                device=torch_device(), n=p.pretrain.labelfree_images)
            write_json(cached, probe(build_encoder(torch_load(pt), meta)[0]))
        monitor = json.loads(pt.with_suffix(".json").read_text())
        rows.append({**json.loads(cached.read_text()), "epoch": monitor["epoch"],
                     "knn_top1": monitor["knn"]["knn_top1"]})
    return rows


def verdict_study(folders: dict[str, Path], *, short: list[str], shards: Path,
                  work: Path) -> dict:
    """The study behind :mod:`pipeline.evaluate.verdict`, from the monitor's numbers alone.

    ``folders``: the full-length runs (a pipeline run's ``plots/`` or a study run's folder)
    for question (a); ``width16`` joins them from :data:`PREVIOUS` (its kept epochs measured
    with the same definitions). ``short``: study runs whose kept epochs are probed here
    (:func:`probe_kept_epochs`), for question (c) beside the full-length runs' ends.
    """
    previous = json.loads(PREVIOUS.read_text())
    full = monitor_study(folders)
    rows = [{**{k: r[v] for k, v in PREVIOUS_KEYS.items()}, "epoch": r["epoch"],
             "knn_top1": r["knn_top1"]} for r in previous["runs"]["width16"]["rows"]]
    full["width16"] = _study_of_rows(f"{PREVIOUS} (epochs 0-5 kept and measured)", rows)
    short_runs = {n: _study_of_rows(str(work / n), probe_kept_epochs(n, shards=shards, work=work))
                  for n in short}
    within = {k: {"mean_rho": round(sum(r["within_run_spearman"][k]["all_epochs"]["rho"]
                                        for r in full.values()) / len(full), 4),
                  "runs": len(full)} for k in MONITOR_NUMBERS}
    # (b) across runs: the cross-run study's 3-epoch encoders, the previous study's two
    # full-length ends, and the ends of the full-length runs given here that it lacks
    from scipy.stats import spearmanr

    old = json.loads(OLD_STUDY.read_text())["encoders"]
    ends = [{k: r[v] for k, v in PREVIOUS_KEYS.items()} | {"knn_top1": r["knn_top1"]}
            for r in (v["rows"][-1] for v in previous["runs"].values())]
    ends += [v["rows"][-1] for n, v in full.items() if n not in previous["runs"]]
    across = {}
    for k in ("rankme", "alignment", "uniformity"):
        pts = [(r[k], r["knn_top1"]) for r in old + ends if r.get(k) is not None]
        rho, pval = spearmanr(*zip(*pts))
        across[k] = {"rho": round(float(rho), 4), "p": float(f"{pval:.3g}"),
                     "encoders": len(pts)}
    return {"full_length_runs": full, "short_runs": short_runs, "within_run_mean": within,
            "known": previous["known"], "across_runs_spearman": across}


def verdict_tables(result: dict) -> str:
    """The study's tables in Markdown, from :func:`verdict_study`'s JSON."""
    names = {"knn_top1": "kNN monitor", "rankme": "RankMe", "view_top1": "view top-1",
             "uniformity": "uniformity", "alignment": "alignment"}
    full, short = result["full_length_runs"], result["short_runs"]
    lines = ["| number | " + " | ".join(f"{n} ({len(v['epochs'])} points)"
                                         for n, v in full.items()) + " | mean |",
             "|---" * (len(full) + 2) + "|"]
    for k in MONITOR_NUMBERS:
        rhos = [v["within_run_spearman"][k]["all_epochs"]["rho"] for v in full.values()]
        lines.append(f"| {names[k]} | " + " | ".join(f"{r:+.2f}" for r in rhos)
                     + f" | **{result['within_run_mean'][k]['mean_rho']:+.2f}** |")
    lines += ["", "| run | " + " | ".join(names.values()) + " |",
              "|---" * (len(names) + 1) + "|"]
    for n, v in {**full, **short}.items():
        lines.append(f"| {n} | " + " | ".join(v["verdicts"].get(k, "") for k in names) + " |")
    lines += ["", "| run | epochs | " + " | ".join(f"{names[k]} init -> end" for k in names)
              + " |", "|---" * (len(names) + 2) + "|"]
    for n, v in {**full, **short}.items():
        init, end = v["rows"][0], v["rows"][-1]
        cells = [(f"{init[k]:.3g} -> {end[k]:.3g}" + ("" if v["end_above_init"][k] == (
                  v["end_above_init"]["knn_top1"]) else " (**other side**)"))
                 if k in init and k in end else "" for k in names]
        lines.append(f"| {n} | {v['epochs'][-1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


PREVIOUS = Path("results/labelfree-verdict-2026-12-06.json")
PREVIOUS_KEYS = {"rankme": "rankme_2048", "view_top1": "view_top1_2048",
                 "uniformity": "uniformity", "alignment": "alignment"}


def torch_device() -> Any:
    import torch

    return torch.device("cpu")


def torch_load(path: Path) -> Any:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("train", "measure", "known", "analyse", "monitor",
                                        "verdicts"))
    ap.add_argument("--short", nargs="*", default=[], help="verdicts: study runs to probe")
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
    elif args.command == "known":
        import torch

        torch.set_num_threads(args.threads or 1)
        sizes = {k: v for k, v in (("n_rank", args.n_rank), ("n_views", args.n_views))
                 if v is not None}
        for name in args.runs or ["default"]:
            known(name, shards=args.shards, work=args.work, **sizes)
    elif args.command in ("monitor", "verdicts"):  # runs: NAME=FOLDER (plots/ or a study run)
        folders = {r.split("=", 1)[0]: Path(r.split("=", 1)[1]) for r in args.runs}
        if args.command == "verdicts":
            import torch

            torch.set_num_threads(args.threads or 1)
            result = verdict_study(folders, short=args.short, shards=args.shards,
                                   work=args.work)
            print(verdict_tables(result))
        else:
            result = monitor_study(folders)
        text = json.dumps(result, indent=1) + "\n"
        if args.out:
            from pipeline.atomic import write_json

            write_json(args.out, result)
        else:
            print(text)
    else:
        result = analyse(args.work, args.runs or list(RUNS))
        text = json.dumps(result, indent=1) + "\n"
        if args.out:
            from pipeline.atomic import write_json

            write_json(args.out, result)
        else:
            print(text)


if __name__ == "__main__":
    main()
