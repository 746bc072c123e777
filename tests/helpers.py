"""Test helpers: tiny real-format shards and a tiny pretraining run (importable by subprocesses)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from pipeline.config import from_dict
from pipeline.data.build import write_shards
from pipeline.data.sources import Sample


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
    mpath = split_dir / "manifest.json"
    m = json.loads(mpath.read_text())
    for s in m["shards"]:
        p = split_dir / s["name"]
        s["bytes"] = p.stat().st_size
        s["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
    m.update(top)
    mpath.write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


def relabel_first_sample(shard: Path) -> None:
    """Change the first sample's label digit in place: same size, still a valid tar that decodes,
    so only the manifest's sha256 can tell."""
    import tarfile

    with tarfile.open(shard) as t:
        cls = next(m for m in t.getmembers() if m.name.endswith(".cls"))
    data = bytearray(shard.read_bytes())
    data[cls.offset_data] = ord("1") if data[cls.offset_data] != ord("1") else ord("2")
    shard.write_bytes(bytes(data))
