"""`dvc repro` gives what the code says: a pixel-path edit retrains, a tracking comment does not.

A tiny Fashion-MNIST repo is trained once. Then, in turn:

* a comment added to ``pipeline/tracking/runs.py`` (no dep of pretrain, outside the
  fingerprint):
  ``dvc repro`` reruns nothing that trains, and the encoder is the same file;
* a change of ``pretrain.log_every_steps`` (a dep of pretrain, outside the fingerprint): DVC
  reruns pretrain, the engine reuses the finished checkpoint and says so in one line, the
  encoder is bit-identical;
* ``decode_record`` in ``pipeline/data/shards.py`` made to invert every decoded pixel (the
  shards themselves are rebuilt byte-identical): the fingerprint changes, so pretraining
  starts again from step 0 in a new resume-store folder and exports a new encoder. Before the
  fingerprint was derived from the imports, this resumed the finished run and exported the
  OLD weights.
"""

from __future__ import annotations

import hashlib
import re

import pytest
import yaml
from repohelpers import make_repo, out, params, ran, sh

pytestmark = pytest.mark.slow

SMALL = {"data": {"max_pretrain_images": 256, "max_train_images": 128, "max_test_images": 64}}


def _md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_stale_weights__pixel_path_edit_retrains_tracking_comment_does_not(tmp_path):
    repo = tmp_path / "repo"
    env = make_repo(repo, params(SMALL))
    sh(["dvc", "repro", "pretrain"], repo, env)
    encoder = repo / "models/encoder.pt"
    trained = _md5(encoder)
    first_folders = {d.name for d in (repo / ".checkpoints/pretrain").iterdir()}

    tracking = repo / "pipeline/tracking/runs.py"
    tracking.write_text(tracking.read_text() + "\n# a comment: no output changes\n")
    again = out(sh(["dvc", "repro", "pretrain"], repo, env))
    assert "pretrain" not in ran(again) and _md5(encoder) == trained

    tree = yaml.safe_load((repo / "params.yaml").read_text())
    tree["pretrain"]["log_every_steps"] += 1
    (repo / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    reused = out(sh(["dvc", "repro", "pretrain"], repo, env))
    assert "pretrain" in ran(reused)
    assert "is a finished training of this fingerprint" in reused, reused[-3000:]
    assert _md5(encoder) == trained

    shards = repo / "pipeline/data/shards.py"
    text = shards.read_text()
    old = '    return record["__key__"], image, label\n'
    assert text.count(old) == 1
    shards.write_text(text.replace(old, '    from PIL import ImageOps\n\n'
                                        '    return record["__key__"], ImageOps.invert(image), '
                                        'label\n'))
    shard_files = sorted((repo / "data/shards").rglob("*.tar"))
    before = {f: _md5(f) for f in shard_files}
    retrained = out(sh(["dvc", "repro", "pretrain"], repo, env))
    assert {f: _md5(f) for f in shard_files} == before  # the data is the same; the code is not
    assert "pretrain" in ran(retrained)
    # a new fingerprint: its own store folder, empty, so training starts at step 0
    fresh = re.findall(r"no checkpoint at \.checkpoints/pretrain/(\w+)/last\.pt: starting fresh",
                       retrained)
    assert len(fresh) == 1 and fresh[0] not in first_folders, retrained[-3000:]
    assert "resuming from" not in retrained and "finished training" not in retrained
    assert _md5(encoder) != trained
