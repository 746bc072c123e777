"""Peak memory of ``build_shards`` on one very large photo (issue 57: a 60 MP JPEG took 2.7 GB).

The photo is real: scikit-learn's ``china.jpg`` (:mod:`sample_photos`), upscaled with PIL's
bicubic filter to ``--width x --height`` (default 9000 x 6667, 60 megapixels) and saved as a
baseline quality-90 JPEG, optionally tagged with an EXIF ``Orientation`` (``--orientation 6``:
a portrait phone photo, stored sideways). It is put where a user puts photos, a
``data.unlabelled_root`` tree with ``data.source: none`` (docs/data.md), and each case builds
the shards with ``build_shards``' own code (:func:`pipeline.data.build.build_all`) in a fresh
child process; its peak resident set is the ``ru_maxrss`` (KiB on Linux) of that child alone,
from ``os.wait4``. The photo is written by a child too: Linux carries the parent's peak into a
child it starts, so the parent stays small (it imports neither PIL nor scikit-learn).

Cases (``--cases``, default all):

* ``whole``: ``data.max_side`` larger than the photo: it is stored whole (its own JPEG bytes),
  the pixel statistics are taken over all 60 M pixels.
* ``whole_png``: the same with ``data.shard_format: png`` (the decoded pixels encoded as PNG).
* ``max_side``: ``data.max_side: 512``: the photo is shrunk to a 512 px short side.
* ``image_size``: ``data.image_size: 224``: shrunk and centre-cropped.

``--copies N`` puts N copies of the photo in the tree (the build reads them one after the
other: the peak shows whether an image is still held while the next one decodes).

``baseline`` is a child that imports the same modules and builds nothing: the interpreter and
the build's own imports alone.

Prints one JSON object: ``{"photo": {...}, "cases": {case: {"peak_rss_mib": ..., ...}}}``.

    python benchmarks/big_photo.py [--width 9000 --height 6667] [--orientation 6] [--copies 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = {"whole": {"max_side": 100_000},
         "whole_png": {"max_side": 100_000, "shard_format": "png"},
         "max_side": {"max_side": 512}, "image_size": {"image_size": 224}}

_CHILD = """
import json, os, sys
from pipeline.config import DataParams
from pipeline.data.build import build_all
args = json.loads(sys.argv[1])
if args.pop("build"):
    os.chdir(args.pop("cwd"))
    m = build_all(DataParams(**args), seed=0, progress=False)["pretrain"]
    print(json.dumps({"images": m.num_samples, "image_shape": m.image_shape,
                      "pixel_mean": m.pixel_mean, "members": m.settings.get("members")}))
else:
    print("{}")
"""


def write_photo(path: Path, *, width: int, height: int, orientation: int) -> dict:
    """Upscale ``china.jpg`` to ``width x height`` and save it as a q90 JPEG at ``path``.

    With ``orientation`` other than 1 the file's pixels are stored as the camera would (turned
    so that the tag turns them back) and the tag is written. Runs in a child process.
    """
    from PIL import Image
    from sample_photos import sample_photos

    photo = sample_photos()[0].resize((width, height), Image.Resampling.BICUBIC)
    exif = Image.Exif()
    if orientation != 1:
        undo = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
                4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
                6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
                8: Image.Transpose.ROTATE_270}[orientation]
        photo = photo.transpose(undo)  # exif_transpose applies the inverse of these
        exif[0x0112] = orientation
    path.parent.mkdir(parents=True, exist_ok=True)
    photo.save(path, format="JPEG", quality=90, subsampling=2, exif=exif.tobytes())
    return {"file": path.name, "stored_size": list(photo.size), "orientation": orientation,
            "megapixels": round(width * height / 1e6, 1), "bytes": path.stat().st_size}


def child(argv: list[str]) -> tuple[dict, int]:
    """Run ``python <argv>`` from the repo root: its last stdout line as JSON, its ru_maxrss."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=out, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise SystemExit(f"child failed ({proc.returncode}): {err.read().strip()[-2000:]}")
        return json.loads(out.read().splitlines()[-1]), usage.ru_maxrss


def run_case(args: dict) -> dict:
    """One build (or the baseline) in a child process; its result and peak RSS in MiB."""
    result, peak_kib = child(["-c", _CHILD, json.dumps(args)])
    return {"peak_rss_mib": round(peak_kib / 1024, 1), **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=9000)
    ap.add_argument("--height", type=int, default=6667)
    ap.add_argument("--orientation", type=int, default=1, choices=range(1, 9))
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--copies", type=int, default=1, help="copies of the photo in the tree")
    ap.add_argument("--write", help="only write the photo to this path (the child's job)")
    a = ap.parse_args()
    if a.write:
        print(json.dumps(write_photo(Path(a.write), width=a.width, height=a.height,
                                     orientation=a.orientation)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "photos"
        photo, _ = child([__file__, "--write", str(root / "a" / "big.jpg"),
                          "--width", str(a.width), "--height", str(a.height),
                          "--orientation", str(a.orientation)])
        for i in range(1, a.copies):
            shutil.copyfile(root / "a" / "big.jpg", root / "a" / f"big{i}.jpg")
        photo["copies"] = a.copies
        cases = {"baseline": run_case({"build": False})}
        for name in a.cases:
            args = {"build": True, "cwd": tmp, "source": "none", "unlabelled_root": str(root),
                    "shards_dir": str(Path(tmp) / f"shards-{name}"), **CASES[name]}
            cases[name] = run_case(args)
    print(json.dumps({"photo": photo, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
