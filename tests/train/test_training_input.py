"""The training input: every input of the resume key changes it, nothing else does; the three
consumers (resume key, registry tags, dvc.yaml's pretrain params) come from one list."""

from __future__ import annotations

import enum
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import build_tiny_shards

from pipeline.config import Params, flatten, from_dict, to_dict
from pipeline.data.manifest import read_manifest
from pipeline.train.training_input import (
    NOT_WEIGHT_PARAMS,
    WEIGHT_PARAMS,
    params_digest,
    training_input,
    weight_params,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    shards = build_tiny_shards(tmp_path_factory.mktemp("shards"), n_pretrain=32, n_train=16,
                               n_test=16)
    return read_manifest(shards / "pretrain")


def _set(p: Params, dotted: str, value: Any) -> Params:
    tree = to_dict(p)
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    # the schema's types and ranges, not the checks across sections (a colour preset on grey
    # images): the key does not depend on them
    return Params.model_validate(tree)


def _other_values(p: Params, dotted: str) -> list[Any]:
    """Valid-looking other values for a leaf, tried in turn (the schema refuses some)."""
    section, *rest = dotted.split(".")
    obj: Any = p
    for part in dotted.split("."):
        obj = getattr(obj, part)
    value = flatten(to_dict(p))[dotted]
    if isinstance(obj, enum.Enum):
        # as YAML gives them: a Switch's true/false are booleans in params.yaml
        return [yaml.safe_load(m.value) for m in type(obj) if m.value != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value * 2, max(value - 1, 0)]
    if isinstance(value, float):
        return [value * 2 if value else 0.5, value / 2, value + 0.1]
    if isinstance(value, list):
        return [value + [value[-1] + 1] if value else [1], value[:-1]]
    return [value + "x", *(w for w in ("auto", "probe") if w != value), 1]  # text, or a count


def _changed(p: Params, dotted: str) -> Params:
    for other in _other_values(p, dotted):
        try:
            return _set(p, dotted, other)
        except Exception:  # noqa: BLE001 - the schema refused this value: try the next
            continue
    raise AssertionError(f"{dotted}: no other valid value among {_other_values(p, dotted)}")


BASE = from_dict({})
DECIDING = sorted(flatten(weight_params(BASE)))


def test_weight_params__every_leaf_under_the_list_but_the_not_deciding():
    leaves = flatten(to_dict(BASE))
    under = {k for k in leaves for w in WEIGHT_PARAMS if k == w or k.startswith(w + ".")}
    assert set(DECIDING) == under - set(NOT_WEIGHT_PARAMS)
    assert set(NOT_WEIGHT_PARAMS) <= under  # no stale name in the exemptions
    assert "data.image_size" in DECIDING and "pretrain.lr" in DECIDING
    assert "pretrain.num_threads" not in DECIDING and "knn.k" not in DECIDING


@pytest.mark.parametrize("dotted", DECIDING)
def test_training_input__each_deciding_param_changes_the_key(manifest, dotted):
    before = training_input(BASE, manifest, 1)
    after = training_input(_changed(BASE, dotted), manifest, 1)
    assert after.fingerprint != before.fingerprint
    assert params_digest(_changed(BASE, dotted)) != params_digest(BASE)


@pytest.mark.parametrize("dotted", [*NOT_WEIGHT_PARAMS, "knn.k", "embed.layer",
                                    "mlflow.experiment", "report.tsne_points",
                                    "data.max_test_images"])
def test_training_input__a_param_that_decides_nothing_leaves_the_key(manifest, dotted):
    before = training_input(BASE, manifest, 1)
    assert training_input(_changed(BASE, dotted), manifest, 1).fingerprint == before.fingerprint
    assert params_digest(_changed(BASE, dotted)) == params_digest(BASE)


def test_training_input__world_size_changes_the_key(manifest):
    assert (training_input(BASE, manifest, 2).fingerprint
            != training_input(BASE, manifest, 1).fingerprint)


def test_training_input__a_shard_byte_changes_the_key(manifest):
    before = training_input(BASE, manifest, 1).fingerprint
    s = manifest.shards[0]
    flipped = s.sha256[:-1] + ("0" if s.sha256[-1] != "0" else "1")
    edited = replace(manifest, shards=(replace(s, sha256=flipped),) + manifest.shards[1:])
    assert training_input(BASE, edited, 1).fingerprint != before


def test_training_input__the_same_shards_elsewhere_keep_the_key(manifest):
    before = training_input(BASE, manifest, 1).fingerprint
    moved = replace(manifest, shards=tuple(replace(s, url=f"https://elsewhere/{s.name}")
                                           for s in manifest.shards),
                    build={**manifest.settings, "parts": ["/somewhere/else"]})
    assert training_input(BASE, moved, 1).fingerprint == before


def test_training_input__the_crop_side_of_whole_images_changes_the_key(manifest):
    # whole-image shards (data.max_side): the shards' bytes are the same for every crop side;
    # only the build's image_size says which crop the loader cuts
    whole = replace(manifest, image_shape=None,
                    build={**manifest.settings, "max_side": 320, "image_size": 32})
    at48 = replace(whole, build={**whole.settings, "image_size": 48})
    a, b = training_input(BASE, whole, 1), training_input(BASE, at48, 1)
    assert (a.image["size"], b.image["size"], a.image["variable"]) == (32, 48, True)
    assert a.fingerprint != b.fingerprint
    assert a.data["sha256"] != b.data["sha256"]


def test_training_input__the_normalisation_changes_the_key(manifest):
    # a joined set takes its mean/std from the train split: the manifest carries them
    before = training_input(BASE, manifest, 1)
    other = replace(manifest, mean=tuple(m + 0.01 for m in manifest.mean))
    after = training_input(BASE, other, 1)
    assert after.image["mean"] != before.image["mean"]
    assert after.fingerprint != before.fingerprint


def test_training_input__a_code_file_in_the_closure_changes_the_key(manifest, tmp_path):
    for part in ("pipeline", "stages"):
        shutil.copytree(REPO / part, tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    before = training_input(BASE, manifest, 1, code_root=tmp_path)
    assert before.fingerprint == training_input(BASE, manifest, 1).fingerprint
    assert "pipeline/moco/queue.py" in before.code
    f = tmp_path / "pipeline/moco/queue.py"
    f.write_text(f.read_text() + "\n# edited\n")
    after = training_input(BASE, manifest, 1, code_root=tmp_path)
    assert after.fingerprint != before.fingerprint and after.params == before.params


def test_dvc_yaml__pretrain_params_are_the_weight_params():
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["pretrain"]
    declared = [next(iter(p)) if isinstance(p, dict) else p for p in stage["params"]]
    assert sorted(declared) == sorted(WEIGHT_PARAMS)
    assert len(declared) == len(set(declared))
