"""`make bench`: run every benchmark, write benchmarks/results.json and print a table.

Each benchmark is a script that prints one JSON object (medians of several runs). The pretrain
benchmarks need the default shards (`dvc repro build_shards` first).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
BENCHES = {
    "data": ["data_throughput.py"],
    "photo_loader": ["photo_loader.py"],
    "big_photo": ["big_photo.py"],
    "pretrain_step": ["pretrain_step.py"],
    "width_precision": ["width_precision.py"],
    "queue": ["queue_bench.py"],
    "knn": ["knn_bench.py"],
    "near_duplicates": ["near_duplicates.py", "--sizes", "60000x256"],
    "linear_probe": ["linear_probe.py"],
    "step_profile": ["step_profile.py"],
    "gpu": ["gpu.py"],
}


def run(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, str(HERE / args[0]), *args[1:]], capture_output=True,
                          text=True)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    text = proc.stdout
    return json.loads(text[text.index("{"):])


def table(res: dict) -> str:
    d, s, q, k = res["data"], res["pretrain_step"], res["queue"], res["knn"]
    rows = [("benchmark", "value")]
    if "error" not in d:
        rows.append(("shard build (img/s)", f"{d['shard_build']['images_per_s']}"))
        for w, v in d["train_loader"]["by_num_workers"].items():
            rows.append((f"train loader, uint8 batches, {w} workers (img/s)",
                         f"{v['images_per_s']}"))
        for kind, v in d["two_crop_v2_grey_pairs_per_s_1_thread"].items():
            rows.append((f"two-crop v2_grey, 1 thread, {kind} (pairs/s)", f"{v}"))
    if "error" not in s:
        prec = s["config"]["precision"]
        for name, rate in s["images_per_s"].items():
            rows.append((f"pretrain, {name.replace('_', ' ')}, {prec} (img/s; / plain)",
                         f"{rate} ({s['over_plain'][name]})"))
        rows += [("stage data-wait fraction", f"{s['stage_data_wait_fraction']}"),
                 ("two views alone, on the device (pairs/s)", f"{s['views_pairs_per_s']}")]
    g = res.get("gpu", {})
    for r in g.get("runs", []):
        rows.append((f"GPU {r['model']} {r['image_size']}px {r['dtype']} "
                     f"channels_last={r['channels_last']} (img/s)", f"{r['images_per_s']}"))
    wp = res.get("width_precision", {})
    for r in wp.get("results", []):
        rows.append((f"MoCo step, width {r['width']}, fp32 / bf16 (img/s)",
                     f"{r['fp32_images_per_s']} / {r['bf16_images_per_s']}"))
    if "error" not in q:
        rows += [(f"enqueue, K={r['K']} (us)", f"{r['enqueue_us']}") for r in q["results"]]
    if "error" not in k:
        rows.append(("kNN 10k x 60k, D=512 (s)", f"{k['seconds_median']}"))
    nd = res.get("near_duplicates", {})
    for r in nd.get("runs", []):
        rows.append((f"near-duplicate search {r['images']} x {r['dim']} (s; MiB over the "
                     "features)", f"{r['seconds']}; {r['search_peak_extra_mib']}"))
    lp = res.get("linear_probe", {})
    if "seconds_median" in lp:
        rows.append((f"linear probe {lp['n']} x {lp['dim']}, {lp['epochs']} epochs, rows "
                     "normalised once / per batch (s)",
                     f"{lp['seconds_median']['once']} / {lp['seconds_median']['per_batch']}"))
    sp = res.get("step_profile", {})
    if "share_percent" in sp:
        rows.append((f"MoCo step {sp['precision']}: convolution / batch norm / rest (% CPU)",
                     " / ".join(str(v) for v in sp["share_percent"].values())))
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


def main() -> None:
    results = {"machine": {"cpu_threads": torch.get_num_threads(),
                           "platform": platform.platform(), "torch": torch.__version__}}
    for name, args in BENCHES.items():
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = run(args)
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    errors = {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    if errors:
        print(f"errors: {errors}", file=sys.stderr)


if __name__ == "__main__":
    main()
