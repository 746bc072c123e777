"""What the label-free work costs on top of a `dvc repro`: wall time and peak memory per stage.

Run it in a workspace where `dvc repro` has finished (the default params: 60,000 pretraining
images). It reruns, one after the other, each as its own process under ``/usr/bin/time``:

* ``data_insights`` (near-duplicates and outliers; its forward pass also gives ``embed`` the
  train split's features);
* ``embed`` as the pipeline runs it (train features reused from ``data_insights``), then
  ``embed`` with no features to reuse (the files moved aside and put back): the difference is
  the forward pass that ``data_insights`` takes over from ``embed``;
* ``label_efficiency``.

Each stage writes the same features, evaluation files and curves it wrote in the `dvc repro`
(seeded, deterministic on one machine); its metrics file (wall times) and ``runs/<stage>.json``
(MLflow run ids) change, so `dvc status` then lists those. Measure alone: a busy neighbour
doubles every number here. The label-free monitor inside
``pretrain`` is read from ``runs/pretrain.log`` when given with ``--pretrain-log`` (its
``label-free (N images): ... (S s)`` lines). The new work is

    data_insights + label_efficiency + monitor - (embed without reuse - embed with reuse)

and its share is against ``--repro-s`` (the whole `dvc repro` wall time, seconds) when given.

Usage::

    python benchmarks/quality_overhead.py [--pretrain-log LOG] [--repro-s S]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def timed(script: str) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of ``python <script>`` in the working directory."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as f:
        proc = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", f.name, sys.executable,
                               script], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{script} failed:\n{proc.stderr[-3000:]}")
        wall, kib = f.read().split()[-2:]
    return float(wall), float(kib) / 1024


def monitor_seconds(log: Path) -> tuple[int, float]:
    """(monitor points, seconds) of the label-free monitor lines of a pretrain log."""
    times = [float(s) for s in re.findall(r"label-free \(\d+ images\):.*\(([\d.]+)s\)",
                                          log.read_text())]
    return len(times), sum(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pretrain-log", type=Path, help="the pretrain stage's log")
    ap.add_argument("--repro-s", type=float, help="wall seconds of the whole dvc repro")
    a = ap.parse_args()
    rows: dict[str, tuple[float, float]] = {}
    rows["data_insights"] = timed("stages/data_insights.py")
    rows["embed (train reused)"] = timed("stages/embed.py")
    aside = Path(tempfile.mkdtemp(prefix="reuse-"))
    moved = [p for p in (Path("features/pretrain.pt"), Path("features/pretrain_global.pt"))
             if p.exists()]
    for p in moved:
        shutil.move(p, aside / p.name)
    try:
        rows["embed (no reuse)"] = timed("stages/embed.py")
    finally:
        for p in moved:
            shutil.move(aside / p.name, p)
    rows["label_efficiency"] = timed("stages/label_efficiency.py")
    for name, (wall, mib) in rows.items():
        print(f"{name:24s} {wall:7.1f} s  peak RSS {mib:7.0f} MiB")
    new = (rows["data_insights"][0] + rows["label_efficiency"][0]
           - (rows["embed (no reuse)"][0] - rows["embed (train reused)"][0]))
    if a.pretrain_log:
        points, secs = monitor_seconds(a.pretrain_log)
        print(f"{'label-free monitor':24s} {secs:7.1f} s  ({points} points)")
        new += secs
    print(f"{'new work':24s} {new:7.1f} s")
    if a.repro_s:
        print(f"share of the whole dvc repro ({a.repro_s:.0f} s): {100 * new / a.repro_s:.1f} %"
              f" (against the repro without it: {100 * new / (a.repro_s - new):.1f} %)")


if __name__ == "__main__":
    main()
