"""What only the data can refute, refused before a stage deletes its outputs.

``check_against_data`` (the ``check_data`` stage and ``pretrain``): a colour augmentation preset
on 1-channel pretraining images. The ``check_eval`` stage does not refuse: without labelled train
or test images (``data.source: none``) it stamps the evaluation as skipped, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import TINY, build_tiny_shards, says

from pipeline.config import ParamsError, from_dict
from pipeline.data.build import empty_split
from pipeline.data.checks import check_against_data
from pipeline.data.manifest import Manifest

ROOT = Path(__file__).resolve().parents[1]
FOLDER = {"data": {"source": "imagefolder", "root": "data/raw/images"}}


def _manifest(mode: str, n: int = 500) -> Manifest:
    """The joined pretraining set's manifest as far as the check reads it (no shards listed)."""
    return Manifest(source="imagefolder+webdataset", split="pretrain", num_samples=n, mode=mode,
                    class_names=(), mean=(), std=(), shards=(),
                    image_shape=(1 if mode == "L" else 3, 28, 28),
                    build={"parts": ["data/shards/pretrain", "data/index/pretrain"]})


@pytest.mark.parametrize("preset", ["v1", "v2", "v2_small"])
def test_check_against_data__colour_preset_on_grey_images_refused(preset):
    # an imagefolder: only its images say grey or colour (fashion_mnist is refused by the
    # params alone, tests/test_config.py)
    p = from_dict({**TINY, **FOLDER, "augment": {"preset": preset}})
    with pytest.raises(ParamsError) as e:
        check_against_data(p, _manifest("L"), "data/shards/pretrain")
    assert e.value.key == "augment.preset"
    says(str(e.value), f"'augment.preset' = '{preset}'", "allowed: v2_grey", "1-channel",
         "mode L, data/shards/pretrain + data/index/pretrain")


@pytest.mark.parametrize(("preset", "mode"), [("v2", "RGB"), ("v1", "RGB"), ("v2_grey", "L"),
                                              ("v2_grey", "RGB")])
def test_check_against_data__preset_that_fits_the_channels_passes(preset, mode):
    p = from_dict({**TINY, **FOLDER, "augment": {"preset": preset}})
    check_against_data(p, _manifest(mode), "data/shards/pretrain")  # no error


def _check_eval(wd: Path) -> subprocess.CompletedProcess:
    (wd / "params.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(TINY))))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "stages/check_eval.py"), "--params",
                           "params.yaml"], cwd=wd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_check_eval_stage__labelled_splits_pass_with_a_content_stable_stamp(tmp_path):
    build_tiny_shards(tmp_path / "data" / "shards", n_pretrain=32, n_train=8, n_test=8)
    res = _check_eval(tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    stamp = (tmp_path / "runs/check_eval.json").read_bytes()
    (tmp_path / "runs/check_eval.json").unlink()
    assert _check_eval(tmp_path).returncode == 0
    assert (tmp_path / "runs/check_eval.json").read_bytes() == stamp


@pytest.mark.parametrize("empty", ["train", "test"])
def test_check_eval_stage__no_labelled_images_stamped_skipped_naming_the_split(tmp_path, empty):
    shards = tmp_path / "data" / "shards"
    build_tiny_shards(shards, n_pretrain=32, n_train=8, n_test=8)
    for f in (shards / empty).iterdir():
        f.unlink()
    empty_split(shards / empty, split=empty, source="none", class_names=[], mode="L", build={})
    res = _check_eval(tmp_path)
    # not a refusal: the evaluation stages are skipped and dvc repro goes on to the report
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    stamp = json.loads((tmp_path / "runs/check_eval.json").read_text())
    assert stamp == {"stage": "check_eval", "run_id": None, "labelled": False,
                     "skipped": f"no labelled {empty} images (data.source none)"}
