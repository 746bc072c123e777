"""dvc.yaml deps follow the imports: every pipeline module a stage runs is a dep of that stage.

DVC reruns a stage only when one of its deps changes. A stage whose script imports a module that
is not a dep would keep stale outputs after that module changes, so this test computes each
stage's import closure inside ``pipeline/`` (the way Python executes it: ``import a.b.c`` runs
``a/__init__.py``, ``a/b/__init__.py`` and ``a/b/c.py``) and requires every module in it to be
covered by a dep (the file itself, or a directory above it), or to be in
:data:`pipeline.codegraph.NOT_OUTPUT_CODE` (the same closure as the resume fingerprint's code).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.codegraph import REPO, import_closure, not_output_code, runs_no_code


def _stage_script(cmd: str) -> Path:
    if m := re.search(r"python (stages/\w+\.py)", cmd):
        return REPO / m.group(1)
    if "python -m pipeline" in cmd:
        return REPO / "pipeline/__main__.py"
    raise AssertionError(f"cannot tell the script of stage command {cmd!r}")


def _stages() -> dict[str, dict]:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def _covered(module: str, deps: list[str]) -> bool:
    return any(module == d or module.startswith(d.rstrip("/") + "/") for d in deps)


def missing_deps(stage: dict) -> list[str]:
    """Modules in a stage's import closure that no dep, NOT_OUTPUT_CODE or emptiness covers."""
    script = _stage_script(stage["cmd"])
    deps = [d if isinstance(d, str) else next(iter(d)) for d in stage.get("deps", [])]
    assert script.relative_to(REPO).as_posix() in deps, f"{script} is not a dep of its stage"
    return sorted(m for m in import_closure(script)
                  if not_output_code(m) is None and not _covered(m, deps)
                  and not runs_no_code(REPO / m))


def _entries(stage: dict, field: str) -> list[str]:
    """A stage's ``deps`` or ``params`` as names: ``{path: {...}}`` is ``path``, a params-file
    entry ``{file: [keys]}`` is ``file:key`` per key (a key of params.yaml is just the key)."""
    out = []
    for entry in stage.get(field, []):
        if isinstance(entry, str):
            out.append(entry)
        elif field == "params":
            for file, keys in entry.items():
                out += [f"{file}:{k}" for k in (keys or [])]
        else:
            out.append(next(iter(entry)))
    return out


def repeated_entries(stage: dict) -> list[str]:
    """Deps and params a stage lists twice, or inside another entry of its list.

    A dep inside a listed directory, or a param inside a listed section (``model.width`` beside
    ``model``), adds nothing: DVC already watches it, and a list that repeats itself hides which
    entry was meant (and that the other one went stale).
    """
    out = []
    for field, sep in (("deps", "/"), ("params", ".")):
        names = _entries(stage, field)
        for i, name in enumerate(names):
            if name in names[:i]:
                out.append(f"{field}: {name} listed twice")
            out += [f"{field}: {name} is inside {other}" for other in names
                    if name.startswith(other.rstrip(sep) + sep)]
    return out


@pytest.mark.parametrize("name", sorted(_stages()))
def test_dvc_deps__no_stage_lists_an_entry_twice(name):
    assert repeated_entries(_stages()[name]) == [], f"stage {name} in dvc.yaml"


def test_dvc_deps__repeated_entries_are_caught():
    # planted on the real pretrain stage: each addition is named, nothing else
    stage = dict(_stages()["pretrain"])
    assert repeated_entries(stage) == []
    stage["deps"] = [*stage["deps"], "pipeline/seeds.py", "pipeline/moco/queue.py"]
    stage["params"] = [*stage["params"], "seed", "model.width",
                       {"other.yaml": ["a", "a", "b.c", "b"]}]
    assert repeated_entries(stage) == [
        "deps: pipeline/seeds.py listed twice", "deps: pipeline/moco/queue.py is inside "
        "pipeline/moco", "params: seed listed twice", "params: model.width is inside model",
        "params: other.yaml:a listed twice", "params: other.yaml:b.c is inside other.yaml:b"]


@pytest.mark.parametrize("name", sorted(_stages()))
def test_dvc_deps__cover_the_stage_import_closure(name):
    assert missing_deps(_stages()[name]) == [], (
        f"stage {name}: add these to its deps in dvc.yaml (or, if they provably never change "
        "an output's bytes, to NOT_OUTPUT_CODE with the reason)")


@pytest.mark.parametrize("name", sorted(_stages()))
def test_dvc_deps__no_code_dep_outside_the_import_closure(name):
    # a listed module the stage never imports reruns it for nothing (and hides a stale list)
    stage = _stages()[name]
    closure = import_closure(_stage_script(stage["cmd"]))
    for dep in stage["deps"]:
        if isinstance(dep, str) and dep.startswith("pipeline/"):
            assert any(m == dep or m.startswith(dep + "/") for m in closure), (
                f"stage {name}: dep {dep} is not imported by the stage")


def test_dvc_deps__closure_follows_packages_and_lazy_imports(tmp_path):
    # worked by hand on the real tree: stages/knn.py imports pipeline.evaluate.run.knn inside
    # run() (lazily), which imports pipeline.evaluate.knn at module level; the package
    # __init__ files on the way run too. TYPE_CHECKING imports do not run.
    closure = import_closure(REPO / "stages/knn.py")
    assert {"pipeline/__init__.py", "pipeline/evaluate/__init__.py",
            "pipeline/evaluate/run/__init__.py", "pipeline/evaluate/run/knn.py",
            "pipeline/evaluate/knn.py"} <= closure
    assert "pipeline/data/loader.py" not in closure  # the kNN stage reads features only
    assert "pipeline/cli.py" in closure  # reached, but not followed further
    script = tmp_path / "s.py"
    script.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from pipeline.config import Params\n")
    script_rel = REPO / "tests" / "_tmp_deps_script.py"
    shutil.copy(script, script_rel)
    try:
        assert import_closure(script_rel) == set()
    finally:
        script_rel.unlink()


def test_dvc_deps__removing_a_dep_is_caught():
    # the test must fail when a real dep goes: drop pipeline/data/eval_loader.py from embed
    stage = dict(_stages()["embed"])
    stage["deps"] = [d for d in stage["deps"] if d != "pipeline/data/eval_loader.py"]
    assert "pipeline/data/eval_loader.py" in missing_deps(stage)
