"""The resume fingerprint's code follows the imports; each exempt module's reason holds."""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY, run_pretrain

from pipeline.codegraph import (
    PRETRAIN_SCRIPT,
    REPO,
    exempt_files,
    imported_modules,
    not_output_code,
    output_code,
)
from pipeline.config import from_dict
from pipeline.data.manifest import Manifest, read_manifest
from pipeline.train.training_input import training_input

# The pixel path of training, worked out by hand from the code: shards are read and decoded by
# data/shards.py (decode_record), converted to the manifest's mode by data/modes.py,
# shards read in place are opened by data/external.py. None of these three was in the
# hand-kept list the fingerprint used before it was derived.
PIXEL_PATH = ("pipeline/data/shards.py", "pipeline/data/modes.py",
              "pipeline/data/external.py")


def _copy_code(dst: Path) -> Path:
    for part in ("pipeline", "stages"):
        shutil.copytree(REPO / part, dst / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _key(root: Path, manifest: Manifest):
    p = from_dict(TINY)
    return training_input(p, manifest, 1, code_root=root)


def test_output_code__pretrain_holds_the_pixel_path_and_the_math_not_the_exempt():
    code = output_code(PRETRAIN_SCRIPT)
    assert code[0] == PRETRAIN_SCRIPT
    for module in PIXEL_PATH + ("pipeline/train/engine.py", "pipeline/moco/queue.py",
                                "pipeline/moco/momentum.py", "pipeline/data/views.py",
                                "pipeline/data/loader.py", "pipeline/seeds.py"):
        assert module in code, module
    assert [m for m in code if not_output_code(m)] == []
    assert "pipeline/report/build.py" not in code  # the report is not imported by pretraining


@pytest.mark.parametrize("module,old,new", [
    # an edit on the pixel path: invert every decoded pixel (the issue's own case)
    ("pipeline/data/shards.py", "def decode_record(", "def _decode_record_inverted("),
    ("pipeline/data/modes.py", '"""', '"""Edited. '),
    ("pipeline/data/external.py", "IMAGE_MEMBERS = (", "IMAGE_MEMBERS = ('tif', "),
])
def test_fingerprint__an_edit_on_the_pixel_path_changes_it(tiny_shards, tmp_path, module, old,
                                                           new):
    manifest = read_manifest(tiny_shards / "pretrain")
    root = _copy_code(tmp_path)
    before = _key(root, manifest)
    assert before == _key(REPO, manifest)  # a copy of the same code: the same key
    f = root / module
    assert old in f.read_text()
    f.write_text(f.read_text().replace(old, new, 1))
    after = _key(root, manifest)
    assert after.fingerprint != before.fingerprint
    assert after.params == before.params and module in after.code


def test_fingerprint__a_comment_in_the_tracking_module_leaves_it(tiny_shards, tmp_path):
    manifest = read_manifest(tiny_shards / "pretrain")
    root = _copy_code(tmp_path)
    before = _key(root, manifest)
    f = root / "pipeline/tracking/runs.py"
    f.write_text(f.read_text() + "\n# a comment\n")
    assert _key(root, manifest).fingerprint == before.fingerprint


def test_fingerprint__a_new_module_imported_by_training_enters_it(tiny_shards, tmp_path):
    manifest = read_manifest(tiny_shards / "pretrain")
    root = _copy_code(tmp_path)
    (root / "pipeline/extra_math.py").write_text("SCALE = 1.0\n")
    engine = root / "pipeline/train/engine.py"
    engine.write_text(engine.read_text().replace(
        "from pipeline.seeds import batch_seed",
        "from pipeline.extra_math import SCALE  # noqa: F401\n"
        "from pipeline.seeds import batch_seed"))
    key = _key(root, manifest)
    assert "pipeline/extra_math.py" in key.code
    before = key.fingerprint
    (root / "pipeline/extra_math.py").write_text("SCALE = 2.0\n")
    assert _key(root, manifest).fingerprint != before


# --- each exempt module's reason, checked against what really runs -----------------------

_WEIGHTY = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)


def _weighty(value: object, depth: int = 0) -> bool:
    """Whether a value is, or directly holds, a tensor, a module or an optimizer."""
    if isinstance(value, _WEIGHTY):
        return True
    if depth < 2 and isinstance(value, (list, tuple, set)):
        return any(_weighty(v, depth + 1) for v in value)
    if depth < 2 and isinstance(value, dict):
        return any(_weighty(v, depth + 1) for v in value.values())
    return False


def test_not_output_code__no_tensor_passes_through_an_exempt_module(tiny_shards, tmp_path):
    # A whole (tiny) training with an inactive MLflow run: every call into an exempt module's
    # code is recorded with its arguments and return value. None may carry a tensor, a module
    # or an optimizer (it could then change them, or what training reads back).
    from pipeline.tracking import StageRun

    files = {str((REPO / m).resolve()): m for m in exempt_files()}
    calls: dict[str, int] = {}
    carried: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001 (sys.setprofile's signature)
        module = files.get(frame.f_code.co_filename)
        if module is None or event not in ("call", "return"):
            return
        where = f"{module}:{frame.f_code.co_name}"
        if event == "call":
            calls[module] = calls.get(module, 0) + 1
            bad = [k for k, v in frame.f_locals.items() if _weighty(v)]
            carried.extend(f"{where} argument {k}" for k in bad)
        elif _weighty(arg):
            carried.append(f"{where} returned one")

    sys.setprofile(profile)
    try:
        run_pretrain(tiny_shards, tmp_path, {"pretrain": {"epochs": 1}}, run=StageRun(None))
    finally:
        sys.setprofile(None)
    assert carried == []
    # not vacuous: training did call into the tracking and signal modules
    assert calls.get("pipeline/tracking/runs.py", 0) > 0 and calls.get("pipeline/signals.py", 0) > 0
    # the stage entry and the registry are never called by training itself
    assert not {"pipeline/cli.py", "pipeline/tracking/model.py",
                "pipeline/tracking/registry.py"} & set(calls)


def _calls(tree: ast.AST, name: str) -> list[int]:
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "id", getattr(n.func, "attr", None)) == name]


def test_not_output_code__the_registry_runs_after_the_encoder_is_written():
    # the registry's reason: called after the encoder file is written. In the stage script
    # every call into it comes after the training call; no module of the training code
    # imports it.
    tree = ast.parse((REPO / PRETRAIN_SCRIPT).read_text())
    (train_call,) = _calls(tree, "pretrain")
    published = _calls(tree, "publish_encoder")
    assert published and min(published) > train_call
    for module in output_code(PRETRAIN_SCRIPT)[1:]:
        assert not {"pipeline.tracking.model", "pipeline.tracking.registry"} & imported_modules(
            REPO / module), module


def test_not_output_code__the_stage_entry_is_imported_by_no_library_module():
    # cli's reason: it is the stage entry, above the library: scripts call it, and no module of
    # pipeline/ but the command line (__main__) imports it, so training never calls into it
    for f in sorted((REPO / "pipeline").rglob("*.py")):
        rel = f.relative_to(REPO).as_posix()
        if rel not in ("pipeline/cli.py", "pipeline/__main__.py"):
            assert "pipeline.cli" not in imported_modules(f), rel
