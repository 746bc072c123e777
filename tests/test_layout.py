"""The house rules of pipeline/: layers only import downwards, no import cycles, short functions
and modules.

Layers, lowest first: a module may import its own layer and the layers below it, never above.
A new module must be given a layer here (the test fails for a module it cannot place).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "pipeline"

# (layer, module prefixes); the longest matching prefix decides; "=name" matches name only (a
# package's __init__, which re-exports its modules)
LAYERS = [
    (0, ["pipeline.config", "pipeline.atomic", "pipeline.signals", "pipeline.seeds",
         "pipeline.schedules", "pipeline",
         # what config.validate calls: pure checks on params and numbers (no torch, no I/O)
         "pipeline.data.checks", "pipeline.moco.geometry"]),
    # raw dataset readers, URLs, worker deaths, image views
    (1, ["pipeline.data.remote", "pipeline.data.external", "pipeline.data.workers",
         "pipeline.data.views", "pipeline.data.jpeg", "pipeline.data.sources"]),
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
    (11, ["pipeline.cli", "pipeline.__main__"]),
]
MAX_BODY_LINES = 60  # a longer function says why in its docstring ("Long because ...")
MAX_MODULE_LINES = 550  # a longer module holds more than one concept: split it
MAX_CONFIG_LINES = 450  # params: read by DVC's reader, typed by pydantic, nothing else


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def layer(module: str) -> int:
    best, found = -1, None
    for n, prefixes in LAYERS:
        for p in prefixes:
            if p.startswith("="):
                if module == p[1:]:
                    return n
            elif (module == p or module.startswith(p + ".")) and len(p) > best:
                best, found = len(p), n
    assert found is not None, f"{module}: no layer in tests/test_layout.py"
    return found


def _imports(path: Path, *, module_level_only: bool) -> set[str]:
    """pipeline.* modules a file imports (TYPE_CHECKING blocks skipped)."""
    known = _modules()
    names: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)) and (top or not module_level_only):
            if isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            elif node.module and node.level == 0:
                cands = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                cands = []
            names.update(c for c in cands if c in known)
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                               ast.ClassDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    tree = ast.parse(path.read_text())
    for node in tree.body:
        visit(node, True)
    return names


@pytest.mark.parametrize("module", sorted(_modules()))
def test_layout__imports_only_go_down(module):
    mine = layer(module)
    up = sorted(m for m in _imports(_modules()[module], module_level_only=False)
                if layer(m) > mine and not module.startswith(m))
    assert up == [], f"{module} (layer {mine}) imports a higher layer: {up}"


def test_layout__no_import_cycles_at_module_level():
    mods = _modules()
    graph = {m: {i for i in _imports(f, module_level_only=True) if i != m and not
                 m.startswith(i + ".")} for m, f in mods.items()}
    state: dict[str, int] = {}

    def dfs(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [m, n]))
            if n not in state:
                dfs(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m, [])


def _long_functions() -> list[str]:
    out = []
    for m, f in sorted(_modules().items()):
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


def test_layout__functions_are_short_or_say_why():
    assert _long_functions() == []


def test_layout__modules_are_short():
    lines = {m: len(f.read_text().splitlines()) for m, f in _modules().items()}
    assert {m: n for m, n in lines.items() if n > MAX_MODULE_LINES} == {}
    assert lines["pipeline.config"] <= MAX_CONFIG_LINES


def test_layout__the_checks_catch_what_they_claim(tmp_path):
    # worked by hand: pipeline.moco (layer 5) importing pipeline.train (layer 7) goes up
    assert layer("pipeline.moco.queue") == 5 and layer("pipeline.train.engine") == 7
    assert layer("pipeline.evaluate.run.knn") == 8 and layer("pipeline.evaluate.knn") == 6
    assert layer("pipeline.data.sources") == 3 and layer("pipeline.data.sources.idx") == 1
    src = "import x\n" + "\n".join(f"    y{i} = {i}" for i in range(61))
    tree = ast.parse("def f():\n" + src.split("\n", 1)[1])
    fn = tree.body[0]
    assert fn.body[-1].end_lineno - fn.body[0].lineno + 1 == 61 > MAX_BODY_LINES
