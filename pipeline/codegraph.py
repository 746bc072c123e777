"""Which library code a stage runs: its import closure inside ``pipeline/``, read from the source.

Two lists must follow the code rather than a hand: each stage's code deps in ``dvc.yaml``
(checked by ``tests/test_dvc_deps.py``) and the code part of the resume fingerprint
(:func:`pipeline.train.training_input.training_input`: a checkpoint made by other training
code is never resumed). Both come from :func:`import_closure`: the ``pipeline/`` files that
running a script may execute, found by walking its ``import`` statements the way Python runs
them (``import a.b.c`` runs ``a/__init__.py``, ``a/b/__init__.py`` and ``a/b/c.py``; imports
inside functions count; ``if TYPE_CHECKING:`` blocks do not run).

The only modules left out are :data:`NOT_OUTPUT_CODE`, each with the reason it cannot change an
output's bytes; their own imports are not followed (what they import serves logging, signal
handling or error messages). ``tests/test_codegraph.py`` checks each reason against the code.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # holds pipeline/ and stages/
PRETRAIN_SCRIPT = "stages/pretrain.py"

# Modules that never change an output's bytes, with the reason (checked by
# tests/test_codegraph.py). Neither dvc.yaml deps nor part of the resume fingerprint, so a
# logging or tracking edit reruns nothing and retrains nothing.
NOT_OUTPUT_CODE: dict[str, str] = {
    "pipeline/cli.py": "the stage entry: argument parsing, logging set-up, an exception turned "
                       "into one `error:` line; it hands the params to the stage and returns "
                       "nothing the stage reads",
    "pipeline/signals.py": "SIGTERM/SIGINT become Terminated, and exit codes: it decides when "
                           "training stops (after a checkpoint), never what a step computes",
    "pipeline/tracking/": "MLflow: runs receive logged numbers, params and file paths and write "
                          "only runs/<stage>.json (a new run id at every execution); the logged "
                          "model and the registry are called after the encoder file is written "
                          "and only read it",
}


def not_output_code(module: str) -> str | None:
    """The reason ``module`` (a root-relative path) is in :data:`NOT_OUTPUT_CODE`, else None.

    A key ending in ``/`` covers every module of that package.
    """
    for key, reason in NOT_OUTPUT_CODE.items():
        if module == key or (key.endswith("/") and module.startswith(key)):
            return reason
    return None


def exempt_files(root: Path = REPO) -> list[str]:
    """Every file :data:`NOT_OUTPUT_CODE` covers, root-relative (packages expanded)."""
    out = []
    for key in NOT_OUTPUT_CODE:
        if key.endswith("/"):
            out += sorted(f.relative_to(root).as_posix() for f in (root / key).rglob("*.py"))
        else:
            out.append(key)
    return out


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imported_modules(path: Path) -> set[str]:
    """Dotted ``pipeline.*`` names whose import a file executes (TYPE_CHECKING blocks skipped).

    ``from pipeline.x import name`` yields both ``pipeline.x`` and ``pipeline.x.name`` (name may
    be a submodule; :func:`module_files` drops it when it is not).
    """
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            for child in node.orelse:  # the `else:` of `if TYPE_CHECKING` does run
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {n for n in names if n == "pipeline" or n.startswith("pipeline.")}


def runs_no_code(path: Path) -> bool:
    """Whether a module holds nothing but a docstring (an empty package ``__init__``)."""
    body = ast.parse(path.read_text(), filename=str(path)).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
               and isinstance(n.value.value, str) for n in body)


def module_files(dotted: str, root: Path = REPO) -> list[Path]:
    """The files executed by importing ``dotted`` (each package ``__init__`` on the way)."""
    parts = dotted.split(".")
    files = []
    for i in range(1, len(parts) + 1):
        base = root.joinpath(*parts[:i])
        if (base / "__init__.py").is_file():
            files.append(base / "__init__.py")
        elif base.with_suffix(".py").is_file():
            files.append(base.with_suffix(".py"))
        else:
            break  # `from pipeline.x import name`: name is not a module
    return files


def import_closure(script: Path, root: Path = REPO) -> set[str]:
    """Root-relative paths of every ``pipeline/`` module that running ``script`` may import.

    Args:
        script: a stage script (or any file under ``root``).
        root: the tree holding ``pipeline/`` (the repo; a copy in tests).

    Returns:
        POSIX paths such as ``pipeline/data/shards.py``; :data:`NOT_OUTPUT_CODE` modules are in
        it when reached, but not followed.
    """
    seen: set[str] = set()
    todo = [script]
    while todo:
        f = todo.pop()
        rel = f.relative_to(root).as_posix()
        if rel in seen:
            continue
        seen.add(rel)
        if not_output_code(rel) is not None:
            continue
        for name in imported_modules(f):
            todo.extend(module_files(name, root))
    seen.discard(script.relative_to(root).as_posix())
    return {m for m in seen if m.startswith("pipeline/")}


def output_code(script: str, root: Path = REPO) -> list[str]:
    """The code that can change a stage's outputs: its script and its closure, less the exempt.

    Args:
        script: the stage script, relative to ``root`` (e.g. ``stages/pretrain.py``).
        root: the tree holding ``pipeline/`` and ``stages/``.

    Returns:
        Sorted root-relative paths, the script first.

    Raises:
        FileNotFoundError: ``script`` is not under ``root`` (the package was installed without
            the repo around it).
    """
    path = root / script
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the stage script is not beside {root / 'pipeline'} "
                                "(run the pipeline from its repo: `pip install -e .`)")
    closure = import_closure(path, root)
    return [script] + sorted(m for m in closure if not_output_code(m) is None)


def code_digest(files: list[str], root: Path = REPO) -> str:
    """sha256 over each file's path and bytes, in the order given (64 hex digits)."""
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.encode() + b"\0")
        h.update((root / rel).read_bytes())
        h.update(b"\0")
    return h.hexdigest()
