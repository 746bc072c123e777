"""``build_shards`` on 1 vs N encoding processes (``data.build_workers``): time, peak memory, bytes.

Each build runs ``build_shards``' own code (:func:`pipeline.data.build.build_all`) on the
default data (all of Fashion-MNIST: 60,000 pretrain + 60,000 train + 10,000 test images, 28 px
PNGs) in a fresh child process, the worker counts alternating (``--repeats`` rounds), so both
see the same machine. Wall time includes starting the processes; the peak RSS is the child's
``ru_maxrss`` (its processes included, from ``os.wait4``). The shards' sha256 (from the
manifests) must be the same for every count. After each build, ``index_shards`` reads that
build's train split in place (60,000 images in 6 shards, as a labelled ``webdataset`` set) on the
same count of processes (``data.build_workers`` serves both); its manifest must be the same too.

Prints one JSON object: per count, the times, the median, the speed-up over 1 process, the
peak RSS and whether the bytes matched.

    python benchmarks/build_workers.py [--workers 1 2] [--repeats 2] [--max-images 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from big_photo import child

_CHILD = """
import json, os, sys, time
from pipeline.config import DataParams
from pipeline.data.build import build_all
args = json.loads(sys.argv[1])
os.chdir(args.pop("cwd"))
t = time.perf_counter()
ms = build_all(DataParams(**args), seed=0, progress=False)
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "images": sum(m.num_samples for m in ms.values()),
                  "sha256": [s.sha256 for m in ms.values() for s in m.shards]}))
"""

# index_shards reading the built train split in place as a labelled webdataset set
_INDEX_CHILD = """
import hashlib, json, sys, time
from pipeline.data.index import index_shards
args = json.loads(sys.argv[1])
t = time.perf_counter()
m, _ = index_shards(args["spec"], split="labelled", key="data.root", max_broken_fraction=0.001,
                    label_field="cls", workers=args["workers"])
wall = time.perf_counter() - t
text = m.to_json().replace(args["spec"], "SPEC")  # the shards' place differs per run
print(json.dumps({"wall_s": wall, "images": m.num_samples,
                  "sha256": [hashlib.sha256(text.encode()).hexdigest()]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-images", type=int, default=0, help="cap of each split, 0 = all")
    a = ap.parse_args()
    runs: dict[int, list[dict]] = {w: [] for w in a.workers}
    index: dict[int, list[dict]] = {w: [] for w in a.workers}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for w in a.workers:
                cap = a.max_images
                args = {"cwd": tmp, "shards_dir": str(Path(tmp) / f"shards-{w}-{r}"),
                        "build_workers": w, "max_pretrain_images": cap,
                        "max_train_images": cap, "max_test_images": cap}
                result, peak_kib = child(["-c", _CHILD, json.dumps(args)])
                runs[w].append({**result, "peak_rss_mib": round(peak_kib / 1024, 1)})
                idx, peak_kib = child(["-c", _INDEX_CHILD, json.dumps(
                    {"spec": str(Path(tmp) / f"shards-{w}-{r}" / "train"), "workers": w})])
                index[w].append({**idx, "peak_rss_mib": round(peak_kib / 1024, 1)})
    print(json.dumps({"build": _summary(runs, a.workers[0]),
                      "index_train_split": _summary(index, a.workers[0])}, indent=1))


def _summary(runs: dict[int, list[dict]], first: int) -> dict:
    """Per count: the times, their median, images/s, the speed-up over ``first``, peak RSS and
    whether every run gave the bytes of ``first``'s first run."""
    base = statistics.median(x["wall_s"] for x in runs[first])
    ref = runs[first][0]["sha256"]
    out = {}
    for w, rs in runs.items():
        med = statistics.median(x["wall_s"] for x in rs)
        out[w] = {"wall_s": [round(x["wall_s"], 2) for x in rs], "median_s": round(med, 2),
                  "images_per_s": round(rs[0]["images"] / med),
                  f"speedup_vs_{first}": round(base / med, 2),
                  "peak_rss_mib": max(x["peak_rss_mib"] for x in rs),
                  "same_bytes": all(x["sha256"] == ref for x in rs)}
    return {"images": runs[first][0]["images"], "workers": out}


if __name__ == "__main__":
    main()
