"""The house rules of pipeline/: layers only import downwards, no import cycles, short functions
and modules.

Layers, lowest first: a module may import its own layer and the layers below it, never above.
A new module must be given a layer here (the test fails for a module it cannot place).

Each rule is a function of a source tree (:func:`unplaced`, :func:`upward_imports`,
:func:`import_cycle`, :func:`long_functions`, :func:`long_modules`): the tests apply them to the
real tree, and ``test_layout__the_checks_catch_what_they_claim`` to planted bad code. Imports
are read as Python runs them (:func:`pipeline.codegraph.imported_modules`, the reader of the
dvc.yaml deps): inside functions too, never in ``if TYPE_CHECKING:`` blocks, and ``import a.b.c``
runs ``a/__init__.py`` and ``a/b/__init__.py`` before ``a/b/c.py``.
"""

from __future__ import annotations

import ast
import graphlib
import os
import subprocess
import sys
from pathlib import Path

from pipeline.codegraph import REPO, imported_modules, module_files, runs_no_code

# (layer, module prefixes); the longest matching prefix decides; "=name" matches name only (a
# package's __init__, which re-exports its modules)
LAYERS = [
    # the package's __init__ (a docstring), params and their pure checks (no torch, no I/O),
    # what a stage read (stage_inputs: params and code deps, compared at its end)
    (0, ["=pipeline", "pipeline.config", "pipeline.atomic", "pipeline.signals", "pipeline.seeds",
         "pipeline.schedules", "pipeline.choices", "pipeline.errors", "pipeline.codegraph",
         "pipeline.stage_inputs", "pipeline.cores",
         "pipeline.data.checks", "pipeline.moco.geometry"]),
    # raw dataset readers, URLs, worker deaths, image views, image modes
    (1, ["pipeline.data.remote", "pipeline.data.external", "pipeline.data.workers",
         "pipeline.data.views", "pipeline.data.jpeg", "pipeline.data.sources",
         "pipeline.data.modes"]),
    (2, ["pipeline.data.shards", "pipeline.data.manifest"]),  # the shard format, its manifest
    # loaders, the index of shards read in place, the sources made of shards
    (3, ["pipeline.data", "pipeline.data.sources.webdataset", "pipeline.data.sources.registry",
         "=pipeline.data.sources"]),
    (4, ["pipeline.data.build"]),  # writing shards from any source
    (5, ["pipeline.moco"]),
    (6, ["pipeline.evaluate"]),  # features, pooling, metrics, heldout, knn, linear
    (7, ["pipeline.train"]),
    (8, ["pipeline.evaluate.run"]),
    (9, ["pipeline.tracking"]),
    (10, ["pipeline.report"]),  # shows the MLflow runs: builds their UI links with tracking
    (11, ["pipeline.cli", "pipeline.__main__", "pipeline.compare"]),
]
MAX_BODY_LINES = 60  # a longer function says why in its docstring ("Long because ...")
MAX_MODULE_LINES = 550  # a longer module holds more than one concept: split it
MAX_CONFIG_LINES = 460  # params: read by DVC's reader, typed by pydantic, nothing else
LIMITS = {"pipeline.config": MAX_CONFIG_LINES}  # modules with their own line limit


def _dotted(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of ``root/pipeline`` by dotted name (a package by its own name)."""
    return {_dotted(f, root): f for f in sorted((root / "pipeline").rglob("*.py"))}


def layer(module: str) -> int | None:
    """The layer of a module (its longest matching prefix in :data:`LAYERS`), or None."""
    best, found = -1, None
    for n, prefixes in LAYERS:
        for p in prefixes:
            if p.startswith("="):
                if module == p[1:]:
                    return n
            elif (module == p or module.startswith(p + ".")) and len(p) > best:
                best, found = len(p), n
    return found


def imports(path: Path, root: Path = REPO) -> set[str]:
    """The pipeline modules that running ``path`` imports, less its own packages.

    Each imported module and every package on the way to it (Python runs their ``__init__``
    first). The module's own packages are left out: their ``__init__`` is already running.
    """
    me = _dotted(path, root)
    out = set()
    for name in imported_modules(path):
        for f in module_files(name, root):
            m = _dotted(f, root)
            if m != me and not me.startswith(m + "."):
                out.add(m)
    return out


def unplaced(root: Path = REPO) -> list[str]:
    """Modules :data:`LAYERS` gives no layer."""
    return [m for m in modules(root) if layer(m) is None]


def upward_imports(root: Path = REPO) -> list[str]:
    """``"a (layer 5) imports b (layer 7)"`` for every import of a higher layer.

    A package whose ``__init__`` runs no code (a docstring) is in no layer's way: importing
    ``pipeline.moco.geometry`` runs the empty ``pipeline/moco/__init__.py`` from any layer.
    """
    mods = modules(root)
    out = []
    for m, f in mods.items():
        mine = layer(m)
        for i in sorted(imports(f, root)):
            theirs = layer(i)
            if (mine is not None and theirs is not None and theirs > mine
                    and not runs_no_code(mods[i])):
                out.append(f"{m} (layer {mine}) imports {i} (layer {theirs})")
    return out


def import_cycle(root: Path = REPO) -> list[str]:
    """One import cycle, ``[a, b, ..., a]`` (a imports b ...), or [] when there is none."""
    graph = {m: sorted(imports(f, root)) for m, f in modules(root).items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(reversed(e.args[1]))  # graphlib lists each module before its importer
    return []


def long_functions(root: Path = REPO) -> list[str]:
    """``"module.function: n lines"`` for bodies over :data:`MAX_BODY_LINES` that do not say
    "Long because" in their docstring (the docstring is not counted)."""
    out = []
    for m, f in modules(root).items():
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            doc = ast.get_docstring(node) or ""
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant):
                body = body[1:]
            if not body:
                continue
            n = body[-1].end_lineno - body[0].lineno + 1
            if n > MAX_BODY_LINES and "Long because" not in doc:
                out.append(f"{m}.{node.name}: {n} lines")
    return out


def long_modules(root: Path = REPO) -> dict[str, int]:
    """``{module: lines}`` over :data:`MAX_MODULE_LINES` (or its own limit in :data:`LIMITS`)."""
    lines = {m: len(f.read_text().splitlines()) for m, f in modules(root).items()}
    return {m: n for m, n in lines.items() if n > LIMITS.get(m, MAX_MODULE_LINES)}


def test_layout__every_module_has_a_layer():
    assert unplaced() == []


def test_layout__imports_only_go_down():
    assert upward_imports() == []


def test_layout__no_import_cycles():
    assert import_cycle() == []


def test_layout__functions_are_short_or_say_why():
    assert long_functions() == []


def test_layout__modules_are_short():
    assert long_modules() == {}


# --- the same rules on planted bad code --------------------------------------------------------


def _plant(root: Path, files: dict[str, str]) -> Path:
    """A tree ``root/pipeline/...`` of the given files, package ``__init__``s added (empty)."""
    for rel, text in {"pipeline/__init__.py": '"""Planted."""\n', **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for parent in path.relative_to(root).parents:
            if parent.parts and not (root / parent / "__init__.py").exists():
                (root / parent / "__init__.py").write_text("")
    return root


def _report(root: Path) -> dict:
    """Every rule's findings on a tree (what a clean tree gives is asserted below)."""
    return {"unplaced": unplaced(root), "upward": upward_imports(root),
            "cycle": import_cycle(root), "long_functions": long_functions(root),
            "long_modules": long_modules(root)}


CLEAN = {"unplaced": [], "upward": [], "cycle": [], "long_functions": [], "long_modules": {}}


def _function(name: str, body_lines: int, doc: str = "") -> str:
    head = f"def {name}():\n" + (f'    """{doc}"""\n' if doc else "")
    return head + "".join(f"    y{i} = {i}\n" for i in range(body_lines))


def test_layout__the_checks_catch_what_they_claim(tmp_path):
    # worked by hand from LAYERS: moco 5, train 7; data 3 but data.sources 1 and its __init__
    # 3; an unknown top-level module has no layer (no catch-all "pipeline" prefix)
    assert (layer("pipeline.moco.queue"), layer("pipeline.train.engine")) == (5, 7)
    assert (layer("pipeline.evaluate.run.knn"), layer("pipeline.evaluate.knn")) == (8, 6)
    assert (layer("pipeline.data.sources"), layer("pipeline.data.sources.idx")) == (3, 1)
    assert (layer("pipeline"), layer("pipeline.newthing")) == (0, None)

    # an upward import inside a function is read; the same under TYPE_CHECKING is not (the
    # empty pipeline/train/__init__.py it also runs is in no layer's way)
    up = _plant(tmp_path / "up", {
        "pipeline/moco/queue.py": "def f():\n    from pipeline.train.engine import g\n"
                                  "    return g\n",
        "pipeline/moco/model.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                  "    from pipeline.train.engine import g\n",
        "pipeline/train/engine.py": "def g():\n    return 1\n"})
    assert _report(up) == {**CLEAN, "upward": [
        "pipeline.moco.queue (layer 5) imports pipeline.train.engine (layer 7)"]}

    # a cycle in one layer closed by an import inside a function
    lazy = _plant(tmp_path / "lazy", {
        "pipeline/data/a.py": "from pipeline.data.b import y\n\nx = y\n",
        "pipeline/data/b.py": "y = 2\n\n\ndef f():\n    from pipeline.data.a import x\n"
                              "    return x\n"})
    assert _report(lazy) == {**CLEAN, "cycle": ["pipeline.data.a", "pipeline.data.b",
                                                "pipeline.data.a"]}

    # the shape of the cycle this test once missed: the index imports a low module of the
    # sources package, whose __init__ imports a source that imports the index. Python
    # itself refuses it.
    init = _plant(tmp_path / "init", {
        "pipeline/data/sources/__init__.py": "from pipeline.data.sources.webdataset import W\n",
        "pipeline/data/sources/webdataset.py": "from pipeline.data.index import index_shards\n\n"
                                               "W = index_shards\n",
        "pipeline/data/sources/modes.py": "to_mode = 1\n",
        "pipeline/data/index.py": "from pipeline.data.sources.modes import to_mode\n\n"
                                  "index_shards = to_mode\n"})
    cycle = import_cycle(init)
    assert cycle[0] == cycle[-1] and sorted(cycle[1:]) == [
        "pipeline.data.index", "pipeline.data.sources", "pipeline.data.sources.webdataset"]
    assert _report(init) == {**CLEAN, "cycle": cycle}
    ran = subprocess.run([sys.executable, "-c", "import pipeline.data.index"], cwd=init,
                         env={**os.environ, "PYTHONPATH": str(init)}, capture_output=True,
                         text=True)
    assert ran.returncode == 1 and "circular import" in ran.stderr

    # 61 body lines fail, 60 pass, and so do 61 that say why; 551 module lines fail, 550 pass;
    # params have 460
    filler = "".join(f"x{i} = {i}\n" for i in range(551))
    long = _plant(tmp_path / "long", {
        "pipeline/errors.py": "\n\n".join([_function("f", 61), _function("g", 60),
                                            _function("h", 61, "Long because it is planted.")]),
        "pipeline/seeds.py": filler, "pipeline/atomic.py": filler[filler.index("x1 ="):],
        "pipeline/config.py": filler[:filler.index("x461 =")],
        "pipeline/newthing.py": ""})
    assert len((long / "pipeline/atomic.py").read_text().splitlines()) == 550
    assert _report(long) == {**CLEAN, "unplaced": ["pipeline.newthing"],
                             "long_functions": ["pipeline.errors.f: 61 lines"],
                             "long_modules": {"pipeline.seeds": 551, "pipeline.config": 461}}
