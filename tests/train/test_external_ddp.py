"""DDP over a pretraining set that joins built shards and WebDataset shards read in place.

Two torchrun processes (gloo) on 96 built images + 2 img2dataset shards of 30 (one broken):
both ranks run the same number of steps of a true epoch of the joined set, and their queues end
bit-identical (keys gathered from both ranks before every enqueue).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import build_tiny_shards, img2dataset_shards

from pipeline.data.index import index_shards
from pipeline.data.manifest import write_manifest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from helpers import run_pretrain
    from pipeline.data.index import pretrain_manifest
    joined = pretrain_manifest(Path({shards!r}), Path({index!r}))
    m = run_pretrain(Path({shards!r}), Path({out!r}),
                     {{"moco": {{"bn": "shuffle"}}, "pretrain": {{"num_workers": 1}}}},
                     pretrain_set=joined)
    Path({out!r}, f"rank{{os.environ['RANK']}}.json").write_text(json.dumps(m))
""")


@pytest.mark.slow
def test_pretrain__torchrun_two_processes_on_a_joined_set(tmp_path):
    shards = build_tiny_shards(tmp_path / "s", n_pretrain=96, per_shard=64)
    img2dataset_shards(tmp_path / "ext", shards=2, per_shard=30, broken={1: 1})
    m, _ = index_shards(str(tmp_path / "ext"), split="pretrain", key="k",
                        max_broken_fraction=0.05)
    write_manifest(m, tmp_path / "idx")
    out = tmp_path / "out"
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=str(ROOT / "tests"), shards=str(shards),
                                    index=str(tmp_path / "idx"), out=str(out)))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29537", str(script)], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m0, m1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert m0["pretrain_images"] == 96 + 59 and m0["broken_images_skipped"] == 1
    assert m0["world_size"] == 2 and m0["steps"] == m1["steps"] == 2 * (155 // 16)
    assert m0["queue_ranks_identical"] == m1["queue_ranks_identical"] == 1
    assert (out / "encoder.pt").exists()
