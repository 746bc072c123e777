"""Test helpers: tiny real-format shards and a tiny pretraining run (importable by subprocesses)."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import re
import socket
import struct
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from pipeline.config import from_dict
from pipeline.data.build import write_shards
from pipeline.data.manifest import read_manifest, write_manifest
from pipeline.data.sources import Sample


def says(text: str, *parts: str) -> None:
    """Assert that ``text`` holds each of ``parts`` (the key, the file, the rule, numbers worked
    out by hand), without pinning the sentence around them, so a wording fix breaks no test."""
    missing = [p for p in parts if p not in text]
    assert not missing, f"{missing} not in: {text}"


def make_samples(n: int, *, size: int = 16, classes: int = 4, seed: int = 0, mode: str = "L"):
    """Images whose class decides a bright quadrant, plus noise (learnable, not trivial)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        c = i % classes
        a = rng.integers(0, 80, size=(size, size), dtype=np.uint8)
        h = size // 2
        r, q = divmod(c % 4, 2)
        a[r * h:(r + 1) * h, q * h:(q + 1) * h] += 150
        img = Image.fromarray(a, "L")
        out.append(Sample(key=f"s{i:05d}", image=img if mode == "L" else img.convert("RGB"),
                          label=c))
    return out


def build_tiny_shards(root: Path, *, n_pretrain: int = 192, n_train: int = 96, n_test: int = 48,
                      size: int = 16, per_shard: int = 64, mode: str = "L") -> Path:
    """``root/{pretrain,train,test}`` shards + manifests; returns ``root``."""
    names = ["a", "b", "c", "d"]
    for split, n, seed in (("pretrain", n_pretrain, 0), ("train", n_train, 1), ("test", n_test, 2)):
        write_shards(make_samples(n, size=size, seed=seed, mode=mode), root / split, split=split,
                     source="synthetic", class_names=names, mode=mode,
                     samples_per_shard=per_shard, progress=False)
    return root


TINY = {
    "model": {"width": 4, "head_hidden": 16, "dim": 8},
    "moco": {"K": 40, "bn_splits": 2},
    "pretrain": {"epochs": 2, "batch_size": 16, "num_workers": 0, "knn_every_epochs": 0,
                 "num_threads": 1,  # fixed: a probed count may differ between two runs
                 "checkpoint_every_steps": 2, "log_every_steps": 2},
    "embed": {"pool_grid": 1},  # 16 px with the stride-2 stem leaves a 1 x 1 last map
    "selection": {"budget": [4, 8]},  # at most the pretraining images of the tiny sets
}


def run_pretrain(shards: Path, out: Path, overrides: dict | None = None, **kw):
    tree = json.loads(json.dumps(TINY))
    for sec, vals in (overrides or {}).items():
        tree.setdefault(sec, {}).update(vals)
    p = from_dict(tree)
    from pipeline.train.engine import pretrain

    ckpt_dir = kw.pop("checkpoint_dir", out / "ckpt")  # a folder, or fingerprint -> folder
    return pretrain(model=p.model, moco=p.moco, opt=p.pretrain, augment=p.augment, seed=p.seed,
                    shards_dir=shards, encoder_path=out / "encoder.pt",
                    checkpoint_dir=ckpt_dir, metrics_path=out / "metrics.json",
                    plots_path=out / "plots.tsv", knn_plots_path=out / "knn.tsv", **kw)


def rewrite_manifest(split_dir: Path, **top: Any) -> None:
    """Re-hash the shards into ``manifest.json`` (bytes, sha256) and set top-level fields."""
    m = read_manifest(split_dir)
    shards = tuple(replace(s, bytes=(split_dir / s.name).stat().st_size,
                           sha256=hashlib.sha256((split_dir / s.name).read_bytes()).hexdigest())
                   for s in m.shards)
    write_manifest(replace(m, shards=shards, **top), split_dir)


def relabel_first_sample(shard: Path) -> None:
    """Change the first sample's label digit in place: same size, still a valid tar that decodes,
    so only the manifest's sha256 can tell."""
    import tarfile

    with tarfile.open(shard) as t:
        cls = next(m for m in t.getmembers() if m.name.endswith(".cls"))
    data = bytearray(shard.read_bytes())
    data[cls.offset_data] = ord("1") if data[cls.offset_data] != ord("1") else ord("2")
    shard.write_bytes(bytes(data))


def img2dataset_shards(root: Path, *, shards: int = 2, per_shard: int = 20, size: int = 16,
                       broken: dict[int, int] | None = None, cls: tuple[int, ...] = (),
                       start: int = 0, seed: int = 0, colour: bool = True) -> list[Path]:
    """Shards in img2dataset's layout: ``<key>.jpg`` + ``.json`` + ``.txt`` per sample.

    Keys are 9-digit running numbers (img2dataset's). ``broken`` = ``{shard: n}`` replaces the
    JPEG of the first ``n`` samples of that shard by truncated bytes; shards in ``cls`` also
    carry ``<key>.cls`` (the class, ``i % 4``, as ASCII). The images are learnable (a bright
    quadrant per class, as :func:`make_samples`), ``size`` px square, RGB or grey.

    Returns:
        The shard paths ``root/{start:05d}.tar``, ...
    """
    import io
    import tarfile

    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(start, start + shards):
        samples = make_samples(per_shard, size=size, seed=seed + s,
                               mode="RGB" if colour else "L")
        path = root / f"{s:05d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i, smp in enumerate(samples):
                key = f"{s:05d}{i:04d}"
                buf = io.BytesIO()
                smp.image.save(buf, format="JPEG", quality=90)
                jpg = buf.getvalue()
                if i < (broken or {}).get(s, 0):
                    jpg = jpg[: len(jpg) // 3]  # a download cut short
                members = {"jpg": jpg, "txt": f"caption {key}".encode(),
                           "json": json.dumps({"key": key, "label": smp.label,
                                               "name": "abcd"[smp.label]}).encode()}
                if s in cls:
                    members["cls"] = str(smp.label).encode()
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size, info.mtime = len(data), 0
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


class FaultServer:
    """``http.server`` on 127.0.0.1 (ephemeral port) over a directory, in a thread, with faults.

    Each fault maps a URL path to what is left of it, consumed one per request: ``fail``,
    status codes answered to any request (HEAD or GET) before the file is served; ``fail_get``,
    the same for GET only; ``drop``, ``reset`` and ``stall``, numbers of GETs that announce the
    whole body (``Content-Length``) and send half of it, then close the connection, reset it
    (TCP RST), or wait ``stall_s`` seconds and close. ``ranges=True`` answers
    ``Range: bytes=N-`` with 206 and the rest of the file; ``http.server`` itself ignores
    ``Range``. ``requests`` logs ``(method, path, Range header)``.
    """

    def __init__(self, directory: Path, *, ranges: bool = False, stall_s: float = 2.0):
        self.fail: dict[str, list[int]] = {}
        self.fail_get: dict[str, list[int]] = {}
        self.drop: dict[str, int] = {}
        self.reset: dict[str, int] = {}
        self.stall: dict[str, int] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **kw):
                super().__init__(*a, directory=str(directory), **kw)

            def _failed(self, *faults: dict[str, list[int]]) -> bool:
                server.requests.append((self.command, self.path, self.headers.get("Range")))
                for codes in faults:
                    if codes.get(self.path):
                        self.send_error(codes[self.path].pop(0))
                        return True
                return False

            def do_HEAD(self):  # noqa: N802 (http.server API)
                if not self._failed(server.fail):
                    super().do_HEAD()

            def do_GET(self):  # noqa: N802 (http.server API)
                if self._failed(server.fail, server.fail_get):
                    return
                cut = next((k for k in ("drop", "reset", "stall")
                            if getattr(server, k).get(self.path)), None)
                start = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if cut is None and not (ranges and start):
                    super().do_GET()
                    return
                data = whole = (directory / self.path.lstrip("/")).read_bytes()
                if ranges and start:
                    data = whole[int(start[1]):]
                    self.send_response(206)
                    self.send_header("Content-Range",
                                     f"bytes {start[1]}-{len(whole) - 1}/{len(whole)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.close_connection = True
                if cut is None:
                    self.wfile.write(data)
                    return
                getattr(server, cut)[self.path] -= 1
                self.wfile.write(data[:len(data) // 2])
                self.wfile.flush()
                if cut == "stall":
                    time.sleep(stall_s)
                elif cut == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                    self.connection.close()

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


REPO = Path(__file__).resolve().parents[1]


def shipped_versions(rel: str) -> list[str]:
    """The texts of a repository file a claim may be checked against: the workspace copy, and
    the committed one (git HEAD) when it differs.

    Tests of what ships (params.yaml equals the schema defaults, the README's numbers equal
    metrics/) pass when either agrees: a user who copied a preset into params.yaml and reran
    the pipeline changed the workspace, not what ships; a developer who changed a default
    and params.yaml together has not committed yet. On a fresh clone both are one text.
    """
    texts = [(REPO / rel).read_text()]
    r = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=REPO, capture_output=True, text=True)
    if r.returncode == 0 and r.stdout != texts[0]:
        texts.append(r.stdout)
    return texts


def load_script(rel: str) -> Any:
    """The module of a script that is not a package (``benchmarks/*.py``, ``stages/*.py``),
    from its path relative to the repository root, imported under a name of its own."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / rel
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_photos(root: Path, **kw: Any) -> list[Path]:
    """Real-photo JPEG crops under ``root`` (``benchmarks/sample_photos.py``'s
    :func:`write_photos`: windows of scikit-learn's two sample photos, quality 90)."""
    return load_script("benchmarks/sample_photos.py").write_photos(root, **kw)


def small_shm(size: str) -> list[str]:
    """A command prefix that runs its command with a fresh ``size`` tmpfs over ``/dev/shm``.

    The tmpfs is mounted in a private mount namespace (``unshare -m``; with ``-r``, a user
    namespace, where root is not), so the machine's ``/dev/shm`` is untouched and the mount goes
    with the command. Skips the calling test where neither is permitted.
    """
    import pytest

    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    why = "unshare not found"
    for namespace in (["unshare", "-m"], ["unshare", "-r", "-m"]):
        prefix = [*namespace, "sh", "-c", script, "sh"]
        try:
            r = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            break
        if r.returncode == 0:
            return prefix
        why = r.stderr.strip()
    pytest.skip(f"cannot mount a tmpfs over /dev/shm in a mount namespace here ({why})")


def processes_in(cwd: Path) -> list[int]:
    """Pids of the processes whose working directory is ``cwd`` (those this user may read)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(proc / "cwd").resolve() == cwd.resolve():
                found.append(int(proc.name))
        except OSError:  # gone, or another user's
            continue
    return found


# the transposition that EXIF orientation o undoes (ImageOps.exif_transpose applies its inverse):
# a camera that writes tag o stores the upright picture turned by this
CAMERA_TURN = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
               4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
               6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
               8: Image.Transpose.ROTATE_270}


def tag_photos(root: Path) -> dict[Path, int]:
    """Rewrite 7 of the JPEGs under ``root`` as a camera stores them with orientation 2..8.

    Each keeps its upright picture (so every photo keeps its size as displayed); its file holds
    the pixels turned by :data:`CAMERA_TURN` and the EXIF tag, at quality 90.

    Returns:
        ``{path: orientation}`` of the rewritten files.
    """
    tagged = {}
    for orientation, path in zip(range(2, 9), sorted(root.rglob("*.jpg"))[::2], strict=False):
        with Image.open(path) as im:
            stored = im.convert("RGB").transpose(CAMERA_TURN[orientation])
        exif = Image.Exif()
        exif[0x0112] = orientation  # EXIF Orientation
        stored.save(path, format="JPEG", quality=90, exif=exif.tobytes())
        tagged[path] = orientation
    return tagged


def upright_reference(data: bytes, reduce: int = 1) -> np.ndarray:
    """What every viewer shows: PIL's decode turned by ``ImageOps.exif_transpose`` (at 1/k)."""
    from PIL import ImageOps

    with Image.open(io.BytesIO(data)) as im:
        if reduce > 1:
            im.draft("RGB", (im.size[0] // reduce, im.size[1] // reduce))
        return np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
