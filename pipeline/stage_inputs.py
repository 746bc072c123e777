"""A stage's inputs must be as they were when it started: params and code unchanged at its end.

DVC records a stage's params (the ``params.yaml`` values of the keys ``dvc.yaml`` lists for it)
and its deps' hashes in ``dvc.lock`` and in its run cache when the stage ENDS
(treeverse/dvc#11058). An edit made while the stage runs is then recorded against outputs
computed from the old values: ``pretrain.lr`` edited during pretraining records the new rate
beside an encoder trained with the old one, and a later ``dvc exp run -S pretrain.lr=<new>``
restores that encoder from the run cache. The stage entry (:func:`pipeline.cli.stage_main`)
takes a :func:`snapshot` before it reads the params and calls :meth:`Snapshot.check` after the
stage body returned: a change is one ``error: InputsChanged: ...`` line and a non-zero exit,
and DVC records nothing for a failed stage. What records a result outside the repo checks
first, while the stage runs (:func:`check_started`): its MLflow run ends FAILED instead of
FINISHED, and no model version is registered, tagged or made the champion.

What is compared:

* params: the keys the stage lists in ``./dvc.yaml`` (the working directory's: DVC runs a stage
  there, also in a ``dvc exp run --temp/--queue`` copy, where ``DVC_ROOT`` names the main repo;
  DVC records that copy's ``params.yaml``), read the way DVC reads them
  (:func:`pipeline.config.read_yaml`). A plain key is looked up in the params file the stage
  reads; ``{file: [keys]}`` in that file. A stage missing from ``dvc.yaml`` (run by hand from
  elsewhere) has no params compared: nothing records them.
* code: the ``.py`` files and package directories among the stage's ``dvc.yaml`` deps
  (:func:`code_deps`; ``tests/test_dvc_deps.py`` keeps them equal to its import closure),
  relative to the working directory, as DVC hashes them. Python imports modules lazily, inside
  functions, so an edit after the start can reach the run, and DVC records the new bytes.
* a params file the stage lists as a whole-file dep (``check_params``), by its bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ParamsError, PipelineError

DVC_YAML = Path("dvc.yaml")


class InputsChanged(PipelineError):
    """A param or code file the stage read changed while it ran (DVC would record the new one)."""


_ABSENT = object()  # a key not in the file


def _value(tree: Any, key: str) -> Any:
    """Dotted ``key``'s value in a parsed params file (``pretrain``: a section; ``""``: all)."""
    node = tree
    for part in key.split(".") if key else []:
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _canon(value: Any) -> Any:
    """A comparable form: mappings in key order, floats by repr (``.nan`` equals ``.nan``)."""
    if isinstance(value, dict):
        return sorted((repr(k), _canon(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_canon(v) for v in value]
    return repr(value) if isinstance(value, float) else value


def _shown(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    try:
        return json.dumps(value, default=str)
    except ValueError:  # a circular YAML anchor
        return repr(value)


def _diff(key: str, old: Any, new: Any) -> list[str]:
    """``'key' (old -> new)`` for each dotted leaf that differs (a section: its leaves)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += _diff(f"{key}.{k}" if key else str(k), old.get(k, _ABSENT),
                         new.get(k, _ABSENT))
        return out
    if (old is _ABSENT) != (new is _ABSENT) or _canon(old) != _canon(new):
        return [f"'{key}' ({_shown(old)} -> {_shown(new)})"]
    return []


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:  # deleted, or a directory now
        return None


def stage_spec(stage: str, dvc_yaml: Path = DVC_YAML) -> dict[str, Any]:
    """``stage``'s entry in ``dvc.yaml`` (empty when the file or the stage is missing).

    Raises:
        ParamsError: ``dvc.yaml`` is not valid YAML (one line).
    """
    from pipeline.config import read_yaml

    if not dvc_yaml.is_file():
        return {}
    spec = ((read_yaml(dvc_yaml) or {}).get("stages") or {}).get(stage)
    return spec if isinstance(spec, dict) else {}


def declared_params(spec: dict[str, Any], params_file: str | Path) -> dict[str, list[str]]:
    """``{params file: [dotted keys]}`` that a ``dvc.yaml`` stage entry lists.

    Args:
        spec: the stage's entry (:func:`stage_spec`).
        params_file: the file the stage reads; plain keys belong to it (DVC's default
            ``params.yaml``, which a stage run by DVC reads).

    Returns:
        An empty key list means the whole file (``- file.yaml:`` in ``dvc.yaml``).
    """
    out: dict[str, list[str]] = {}
    for entry in spec.get("params") or []:
        if isinstance(entry, str):
            out.setdefault(str(params_file), []).append(entry)
        elif isinstance(entry, dict):
            for file, keys in entry.items():
                out.setdefault(str(file), []).extend(keys or [])
    return out


def code_deps(spec: dict[str, Any]) -> list[Path]:
    """The code among a ``dvc.yaml`` stage entry's deps, file by file, as DVC hashes them.

    Code: a ``.py`` file, or a package directory (it holds ``__init__.py``: every file under it,
    templates included, but ``__pycache__``, which ``.dvcignore`` leaves out). Data deps (shards,
    manifests, features; ``${...}`` paths) are left alone: reading them twice would cost as much
    as the stage.
    """
    out: list[Path] = []
    for dep in spec.get("deps") or []:
        path = Path(dep) if isinstance(dep, str) and "${" not in dep else None
        if path is None:
            continue
        if path.suffix == ".py" and path.is_file():
            out.append(path)
        elif (path / "__init__.py").is_file():
            out += sorted(f for f in path.rglob("*") if f.is_file() and "__pycache__" not in
                          f.relative_to(path).parts and f.suffix != ".pyc")
    return out


@dataclass
class Snapshot:
    """What a stage's inputs were when it started (:func:`snapshot`).

    Attributes:
        stage: the stage name.
        params: ``{params file: {dotted key: value}}`` of the keys ``dvc.yaml`` lists.
        files: ``{shown path: (file, sha256 or None when unreadable)}`` of the code and the
            whole-file params deps.
    """

    stage: str
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: dict[str, tuple[Path, str | None]] = field(default_factory=dict)

    def changes(self) -> list[str]:
        """What differs now: ``params.yaml 'pretrain.lr' (0.06 -> 0.03)``, ``pipeline/x.py``."""
        from pipeline.config import read_yaml

        out = []
        for file, values in self.params.items():
            try:
                tree = read_yaml(file) if Path(file).is_file() else None
            except ParamsError:
                tree = None
            if tree is None:
                out.append(f"{file} (missing or not valid YAML now)")
                continue
            for k, v in values.items():
                out += [f"{file} {d}" for d in _diff(k, v, _value(tree, k))]
        out += [shown for shown, (path, digest) in self.files.items() if _digest(path) != digest]
        return out

    def check(self) -> None:
        """Raise when an input changed since :func:`snapshot` (call it after the stage body).

        Raises:
            InputsChanged: one line naming each changed key (old and new value) and file.
        """
        changed = self.changes()
        if not changed:
            return
        again = ("run the experiment again" if os.environ.get("DVC_EXP_NAME")
                 else "rerun `dvc repro`")
        raise InputsChanged(
            f"{self.stage}: changed while the stage ran: {', '.join(changed)}; its outputs come "
            "from what it read at the start, and DVC would record them against the new "
            f"content (treeverse/dvc#11058), so nothing is recorded: {again} to run it on the "
            "current files")


_started: list[Snapshot] = []  # the running stage's snapshot (:func:`watching`)


@contextmanager
def watching(inputs: Snapshot) -> Iterator[None]:
    """Make ``inputs`` the running stage's, for :func:`check_started` (the stage entry's)."""
    _started.append(inputs)
    try:
        yield
    finally:
        _started.remove(inputs)


def check_started() -> None:
    """Check the running stage's inputs now (nothing outside a :func:`watching` block).

    Called before a result is recorded outside the repo (an MLflow run ending FINISHED, a model
    version registered or tagged): an edit made while the stage ran would else be recorded
    there beside outputs DVC refuses.

    Raises:
        InputsChanged: as :meth:`Snapshot.check`.
    """
    for inputs in _started:
        inputs.check()


def snapshot(stage: str, params_file: str | Path) -> Snapshot:
    """The stage's declared params and code as they are now (take it before reading params).

    Taken before the stage reads its params, an edit in between is refused at the end (the
    stage may have read either version) rather than missed.

    Args:
        stage: the stage name (``dvc.yaml``'s, and ``stages/<stage>.py``).
        params_file: the params file the stage reads (``--params``, default ``params.yaml``).

    Raises:
        ParamsError: ``dvc.yaml`` or the params file is not valid YAML (the stage would refuse
            the params file anyway).
    """
    from pipeline.config import read_yaml

    spec = stage_spec(stage)
    snap = Snapshot(stage)
    for file, keys in declared_params(spec, params_file).items():
        if not Path(file).is_file():
            continue  # the stage refuses a missing params file (load_params) before any work
        tree = read_yaml(file)
        snap.params[file] = {k: _value(tree, k) for k in keys or [""]}
    if str(params_file) in (spec.get("deps") or []):  # the whole file is a dep (check_params)
        snap.files[str(params_file)] = (Path(params_file), _digest(Path(params_file)))
    for path in code_deps(spec):
        snap.files[path.as_posix()] = (path, _digest(path))
    return snap
