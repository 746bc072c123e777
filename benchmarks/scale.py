"""How each stage's time, memory and output grow with the number of images (issue 56).

The images: Fashion-MNIST (all 70,000, from the Debian package) replicated to ``N`` training
images plus 10,000 test images, 28 px. Copy 0 is the original set; copy ``c >= 1`` of image
``i`` is a seeded shift by up to 2 px and/or horizontal flip, a transform drawn without
replacement among the 49 for that image, so no two images are the same bytes (checked with a
digest of every image; an image equal to one of its own transforms, e.g. a symmetric one,
would be reported). They are written once per ``N`` as WebDataset shards with ``.cls`` labels,
which the pipeline reads as ``data.source: webdataset`` with ``data.test_fraction`` =
10,000 / (N + 10,000): ``N`` train (= pretrain) images, ~10,000 test images.

Each ``N`` runs the stages of ``dvc.yaml`` in order, each as ``python stages/<stage>.py`` in a
fresh clone of this repository (what ``dvc repro`` runs, without DVC's own bookkeeping), with
the shipped ``params.yaml`` but for: that data, ``mlflow.enabled: false`` (MLflow's 3-4 s per
stage do not depend on N), and ``pretrain.epochs: 1`` with ``pretrain.steps_per_epoch: 5``:
pretraining's steps cost the same per image at any N, so its row is the stage's set-up (data
plan, loader, monitor) and 5 steps. For each stage: wall time (s), peak RSS (MiB: the
``ru_maxrss`` of the stage and the processes it waited for, ``os.wait4``) and the bytes of the
files it wrote, and the largest anonymous memory sampled (``RssAnon``: RSS less the file pages,
such as memory-mapped features, that the kernel can drop and read again), and the commit of
the code, the CPU and the UTC time it ended (sizes measured in separate runs, or stages again
with ``--only``, show in the table's last line). ``--full-up-to`` (default: every N) and
``--above`` run only some stages past a size (e.g. the data stages alone: ``--full-up-to 0
--above check_params index_shards build_shards check_data pretrain``). The images are
written by a child process, so that this one stays small: Linux starts a child's peak RSS at
its parent's.

Results go to ``--out`` (JSON, rewritten after every stage, so a stopped run keeps what it
measured), with, per stage, the exponent ``b`` of a least-squares fit of log(time) =
a + b log(N) over the N measured.

With ``--photos`` the images are ``N`` + 10,000 JPEG photos of 64-128 px a side
(:func:`write_photo_data`) read as ``data.source: imagefolder`` with ``data.max_side: 128``
(each JPEG keeps its bytes) and ``data.image_size: 64``: the photo path of the data stages.

    python benchmarks/scale.py [--sizes 15000 60000 240000 960000] [--out results/scale.json]
    python benchmarks/scale.py --sizes 960000 --keep --work /data/scale  # then, after a change:
    python benchmarks/scale.py --sizes 960000 --work /data/scale --only report
    python benchmarks/scale.py --photos --full-up-to 0 --above check_params index_shards \
        build_shards check_data pretrain --sizes 15000 60000 240000 --out results/scale-photos.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TEST_IMAGES = 10_000
DATA_STAGES = ("check_params", "index_shards", "build_shards", "check_data", "pretrain")
# --above's default: the data stages, pretraining's set-up, and the label-free search with the
# features it gives embed
LARGE_STAGES = DATA_STAGES + ("data_insights", "check_eval", "embed")
_SHIFTS = [(dx, dy, flip) for dx in range(-2, 3) for dy in range(-2, 3) for flip in (0, 1)
           if (dx, dy, flip) != (0, 0, 0)]  # 49 transforms besides the identity


def _transform(image: np.ndarray, dx: int, dy: int, flip: int) -> np.ndarray:
    """``(28, 28)`` uint8 shifted by ``(dx, dy)`` px (zeros fill, as Fashion-MNIST's border)."""
    out = np.zeros_like(image)
    h, w = image.shape
    src = image[:, ::-1] if flip else image
    out[max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        src[max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
    return out


def replicas(total: int, seed: int = 0):
    """``total`` Fashion-MNIST images (train then test, then transformed copies), as samples."""
    from PIL import Image

    from pipeline.data.sources import Sample, open_source

    src = open_source("fashion_mnist", "/usr/share/datasets/fashion-mnist")
    images = np.concatenate([src._parts[s][0].images for s in ("train", "test")])
    labels = np.concatenate([src._parts[s][0].labels for s in ("train", "test")])
    rng = np.random.default_rng(seed)
    n = len(images)
    copies = math.ceil(total / n)
    picks = np.stack([rng.permutation(len(_SHIFTS))[:max(copies - 1, 1)] for _ in range(n)])
    for k in range(total):
        c, i = divmod(k, n)
        arr = images[i] if c == 0 else _transform(images[i], *_SHIFTS[picks[i, c - 1]])
        yield Sample(f"c{c:02d}_{i:05d}", Image.fromarray(np.ascontiguousarray(arr)),
                     int(labels[i]))


def write_data(total: int, out: Path) -> dict:
    """Write ``total`` replicated images as shards in ``out``; count exact duplicates."""
    from pipeline.cores import usable_cores
    from pipeline.data.build import write_shards
    from pipeline.data.encode_pool import EncodePool

    seen: set[bytes] = set()
    dups = 0

    def checked():
        nonlocal dups
        for s in replicas(total):
            d = hashlib.blake2b(s.image.tobytes(), digest_size=16).digest()
            dups += d in seen
            seen.add(d)
            yield s

    t = time.perf_counter()
    with EncodePool(usable_cores()) as pool:
        m = write_shards(checked(), out, split="all", source="fmnist-replicas",
                         class_names=[str(c) for c in range(10)], mode="L",
                         samples_per_shard=10_000, progress=False, pool=pool)
    return {"images": m.num_samples, "exact_duplicates": dups,
            "write_s": round(time.perf_counter() - t, 1)}


def _anon_kib(pid: int) -> int:
    """The ``RssAnon`` of a live process (KiB): its memory that no file backs; 0 once gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def write_photo_data(total: int, out: Path, seed: int = 0) -> dict:
    """``total`` JPEG photos of 64-128 px a side as an ImageFolder in ``out``; exact duplicates.

    Each is a seeded window of one of scikit-learn's two sample photos, maybe flipped, its
    width and height drawn from 64-128 px, saved as a baseline JPEG of quality 90
    (``benchmarks/sample_photos.py``): the photo path's decode, resize and JPEG bytes.
    """
    from sample_photos import jpeg_bytes, photo_crop, sample_photos

    photos = sample_photos()
    seen: set[bytes] = set()
    dups = 0
    t = time.perf_counter()
    for i in range(total):
        w, h = (int(x) for x in np.random.default_rng([seed, 1, i]).integers(64, 129, size=2))
        cls, image = photo_crop(photos, i, width=w, height=h, seed=seed)
        data = jpeg_bytes(image)
        d = hashlib.blake2b(data, digest_size=16).digest()
        dups += d in seen
        seen.add(d)
        (out / cls).mkdir(parents=True, exist_ok=True)
        (out / cls / f"p{i:07d}.jpg").write_bytes(data)
    return {"images": total, "exact_duplicates": dups,
            "write_s": round(time.perf_counter() - t, 1)}


def _stage(repo: Path, stage: str, log: Path | None = None) -> dict:
    """Run one stage in ``repo``: wall s, peak RSS MiB (wait4), bytes of files it wrote.

    The stage's log (stderr: timestamped lines, so its phases can be timed) is copied to
    ``log`` when given.

    Also the largest anonymous memory of the stage's process seen in samples every 0.2 s
    (``peak_anon_mib``: RSS less the file pages, e.g. memory-mapped features, which the kernel
    can drop and read again; a sampled peak, so it can miss a spike shorter than 0.2 s).
    """
    before = time.time()
    with tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen([sys.executable, f"stages/{stage}.py"], cwd=repo,
                                stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(repo)})
        anon = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            anon = max(anon, _anon_kib(proc.pid))
            time.sleep(0.2)
        wall = time.perf_counter() - t
        err.seek(0)
        text = err.read()
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(text)
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(f"{stage} failed: {text[-3000:]}")
    written = sum(p.stat().st_size for p in repo.rglob("*")
                  if p.is_file() and ".git" not in p.parts and p.stat().st_mtime >= before)
    code = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "peak_anon_mib": round(anon / 1024, 1), "bytes_written": written,
            "code": code, "cpu": _cpu(), "ended": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def _cpu() -> str:
    """The CPU's model name and its native bf16 flags (what a row's times depend on)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model name")), "unknown CPU")
    flags = sorted({f for f in ("avx512_bf16", "amx_bf16") if f in info.split()})
    return f"{model} x{os.cpu_count()}" + (f" ({', '.join(flags)})" if flags else "")


def _params(repo: Path, data: Path, n: int, photos: bool = False) -> None:
    p = yaml.safe_load((REPO / "params.yaml").read_text())
    p["data"].update(source="imagefolder" if photos else "webdataset", root=str(data),
                     test_fraction=round(TEST_IMAGES / (n + TEST_IMAGES), 6))
    if photos:  # whole images up to 128 px keep their JPEG bytes; 64 px training crops
        p["data"].update(max_side=128, image_size=64)
    p["mlflow"]["enabled"] = False
    p["pretrain"].update(epochs=1, steps_per_epoch=5)
    (repo / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))


def fit_exponents(results: dict) -> dict:
    """Per stage, the slope of log(wall) vs log(N) over the sizes that ran it (>= 2)."""
    out = {}
    stages = {s for r in results.values() for s in r["stages"]}
    for s in sorted(stages):
        pts = [(int(n), r["stages"][s]["wall_s"]) for n, r in results.items()
               if s in r["stages"]]
        if len(pts) >= 2:
            x, y = np.log([p[0] for p in pts]), np.log([max(p[1], 1e-3) for p in pts])
            out[s] = round(float(np.polyfit(x, y, 1)[0]), 2)
    return out


def _fit(pts: list[tuple[int, float]]) -> tuple[float, float]:
    """``(a, b)`` of log(y) = a + b log(N), least squares."""
    b, a = np.polyfit(np.log([p[0] for p in pts]), np.log([max(p[1], 1e-3) for p in pts]), 1)
    return float(a), float(b)


def _human(seconds: float) -> str:
    """``42 s``, ``7.5 min``, ``3.1 h``, ``2.0 d``."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:,.0f} s"


def _mib(x: float) -> str:
    return f"{x:,.0f}"


def _provenance(stages: dict) -> set[str]:
    """``{"<code> on <cpu>, <first>-<last end>"}`` over one size's stage rows (one per code and
    CPU; rows without an end time, written before it was recorded, give ``<code> on <cpu>``)."""
    runs: dict[tuple[str, str], list[str]] = {}
    for m in stages.values():
        ends = runs.setdefault((m.get("code", "?"), m.get("cpu", "?")), [])
        ends += [m["ended"]] if "ended" in m else []
    return {f"{code} on {cpu}" + (f", {min(ends)}-{max(ends)[-5:]}" if ends else "")
            for (code, cpu), ends in runs.items()}


def table(sizes: dict, ax=None) -> list[str]:  # noqa: ANN001 (a matplotlib Axes)
    """The markdown table of a results file's ``sizes`` (and each stage's line on ``ax``).

    The slope over all sizes (``b (all)``) is lowered by each stage's fixed cost (imports,
    model set-up: ~10 s); the slope of the two largest sizes is the growth to expect, and the
    1M / 10M estimates extend that last segment (an extrapolation, on the same machine).
    """
    ns = sorted(int(n) for n in sizes)
    stages = [s for s in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
              if any(s in sizes[str(n)]["stages"] for n in ns)]
    head = ("| stage | " + " | ".join(f"{n:,}" for n in ns)
            + " | b (all) | b (last 2) | 1M (est.) | 10M (est.) |")
    rows = [head, "|---" * (len(ns) + 5) + "|"]
    colours = [f"C{i}" for i in range(10)] + ["black", "olive", "navy", "maroon"]
    for i, st in enumerate(stages):
        pts = [(n, sizes[str(n)]["stages"][st]["wall_s"]) for n in ns
               if st in sizes[str(n)]["stages"]]
        cells = []
        for n in ns:
            m = sizes[str(n)]["stages"].get(st)
            anon = f" ({_mib(m['peak_anon_mib'])})" if m and "peak_anon_mib" in m else ""
            cells.append("" if m is None else f"{m['wall_s']:,.1f} s / {_mib(m['peak_rss_mib'])}"
                         f"{anon} MiB / {m['bytes_written'] / 2**20:,.0f} MB")
        b_all = _fit(pts)[1] if len(pts) >= 2 else float("nan")
        a, b = _fit(pts[-2:]) if len(pts) >= 2 else (0.0, float("nan"))
        est = [_human(math.exp(a + b * math.log(n))) if len(pts) >= 2 else ""
               for n in (1e6, 1e7)]
        rows.append(f"| `{st}` | " + " | ".join(cells)
                    + f" | {b_all:.2f} | {b:.2f} | {est[0]} | {est[1]} |")
        if ax is not None and len(pts) >= 2 and max(p[1] for p in pts) >= 1.0:
            ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker="osD^v"[i % 5],
                      color=colours[i % len(colours)], label=st)
    return rows + ["", "Measured at (code, CPU, UTC end): " + "; ".join(
        f"{n:,}: " + ", ".join(sorted(_provenance(sizes[str(n)]["stages"]))) for n in ns) + "."]


def report(results_path: Path, doc: Path, figure: Path) -> None:
    """Write :func:`table` (between ``<!-- scale:begin -->`` and ``<!-- scale:end -->`` of
    ``doc``) and the log-log figure of wall time vs N, from a results file of this script."""
    from matplotlib.figure import Figure

    sizes = json.loads(results_path.read_text())["sizes"]
    fig = Figure(figsize=(7, 5))
    ax = fig.add_subplot()
    rows = table(sizes, ax)
    cpus = sorted({m["cpu"].split(" x")[0] for r in sizes.values() for m in r["stages"].values()
                   if "cpu" in m})
    ax.set_xlabel("training images N (+ 10,000 test)")
    ax.set_ylabel(f"wall time (s), 2 cores: {' / '.join(cpus) or 'CPU not recorded'}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110, bbox_inches="tight")
    text = doc.read_text()
    begin, end = "<!-- scale:begin -->", "<!-- scale:end -->"
    i, j = text.index(begin) + len(begin), text.index(end)
    doc.write_text(text[:i] + "\n" + "\n".join(rows) + "\n" + text[j:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[15_000, 60_000, 240_000, 960_000])
    ap.add_argument("--full-up-to", type=int, default=None,
                    help="every stage up to this N, --above's past it (default: every N)")
    ap.add_argument("--above", nargs="+", default=list(LARGE_STAGES),
                    help="the stages run past --full-up-to (default: %(default)s)")
    ap.add_argument("--out", default="results/scale.json")
    ap.add_argument("--work", default=None,
                    help="scratch directory, stage logs in its logs/ (default: a temp dir)")
    ap.add_argument("--photos", action="store_true",
                    help="JPEG photos of 64-128 px (an ImageFolder) instead of Fashion-MNIST")
    ap.add_argument("--keep", action="store_true",
                    help="keep each N's images and clone under --work (for --only)")
    ap.add_argument("--only", nargs="+", default=(),
                    help="run these stages only, in a clone --keep left under --work (brought "
                         "to this repository's HEAD; the other stages' outputs as they are)")
    ap.add_argument("--write-data", nargs=2, metavar=("IMAGES", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--report", action="store_true",
                    help="write --out's table into docs/scaling.md and its figure; run nothing")
    ap.add_argument("--table", action="store_true", help="print --out's table; run nothing")
    a = ap.parse_args()
    if a.table:
        print("\n".join(table(json.loads(Path(a.out).read_text())["sizes"])))
        return
    if a.report:
        report(Path(a.out), REPO / "docs/scaling.md", REPO / "docs/figures/scaling.png")
        return
    if a.write_data:
        writer = write_photo_data if a.photos else write_data
        print(json.dumps(writer(int(a.write_data[0]), Path(a.write_data[1]))))
        return
    stages = list(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    out = Path(a.out)
    results: dict = json.loads(out.read_text())["sizes"] if out.exists() else {}
    work = Path(a.work or tempfile.mkdtemp(prefix="scale-"))
    for n in a.sizes:
        data, repo = work / f"data-{n}", work / f"repo-{n}"
        if a.only and repo.is_dir():  # the kept clone: this repository's HEAD, outputs kept
            for cmd in (["fetch", "-q", "origin", "HEAD"], ["reset", "-q", "--hard", "FETCH_HEAD"]):
                subprocess.run(["git", "-C", str(repo), *cmd], check=True)
            r = results.setdefault(str(n), {"data": {}, "stages": {}})
        else:
            shutil.rmtree(data, ignore_errors=True)
            shutil.rmtree(repo, ignore_errors=True)
            made = json.loads(subprocess.run(  # a child: its peak memory is not carried into
                [sys.executable, __file__, "--write-data", str(n + TEST_IMAGES), str(data)]
                + ["--photos"] * a.photos,  # the stages this process starts
                check=True, capture_output=True, text=True).stdout)
            subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(repo)], check=True)
            r = results[str(n)] = {"data": made, "stages": {}}
        _params(repo, data, n, a.photos)
        every = a.full_up_to is None or n <= a.full_up_to
        for stage in stages if every else [s for s in stages if s in a.above]:
            if a.only and stage not in a.only:
                continue
            r["stages"][stage] = _stage(repo, stage, work / "logs" / f"{n}-{stage}.log")
            print(n, stage, r["stages"][stage], flush=True)
            out.write_text(json.dumps({"sizes": results, "exponents": fit_exponents(results)},
                                      indent=1))
        if not (a.keep or a.only):  # a clone measured again stays for the next --only
            shutil.rmtree(repo, ignore_errors=True)
            shutil.rmtree(data, ignore_errors=True)
    print(json.dumps(fit_exponents(results), indent=1))


if __name__ == "__main__":
    main()
