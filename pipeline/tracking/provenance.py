"""What a run records about where it comes from: git state, DVC's experiment, its process.

* ``git.commit`` and ``git.dirty`` (:func:`git_state`): dirty only for an edit to a tracked file
  other than what the pipeline itself writes (:func:`pipeline_outputs`, read from dvc.yaml).
* DVC's experiment name, baseline rev and stage (:func:`dvc_tags`).
* The process that owns a run (:func:`process_tags`), so that a later stage can tell a run left
  RUNNING by a dead process (:func:`owner_dead`).
* The params, flattened with dots as DVC names them, with nothing secret-looking
  (:func:`loggable_params`).
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
from pathlib import Path

from pipeline.config import Params, flatten, to_dict
from pipeline.errors import InputError
from pipeline.tracking.store import error_summary

log = logging.getLogger(__name__)


_SECRET_WORDS = ("password", "secret", "token", "key_id", "access_key", "credential")


def git_state(cwd: Path | None = None) -> dict[str, str]:
    """Commit hash and dirty flag of the working tree (``unknown`` outside git).

    Dirty means a tracked file differs from the commit: code, params, docs, anything but what
    the pipeline writes itself (the stages' ``outs``, ``metrics`` and ``plots`` and
    ``dvc.lock``: :func:`locked_outputs`, else :func:`pipeline_outputs`). Without that
    exception every run of a clean clone would be dirty, its git-tracked metrics and plots
    being rewritten by the run. Untracked files do not count.
    """

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              timeout=30, cwd=cwd).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        top = Path(git("rev-parse", "--show-toplevel").strip())
        status = git("status", "--porcelain=v1", "-z", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {"git.commit": "unknown", "git.dirty": "unknown"}
    changed = _changed_paths(status)
    if not changed:
        return {"git.commit": commit, "git.dirty": "false"}
    # What the pipeline writes: first what the dvc.lock files record (read in milliseconds;
    # during a `dvc repro` every changed file is there), then, only for a changed file they do
    # not cover, DVC's own index (~1.4 s per stage: its outputs not yet run, dvc.yaml's others)
    if _covered(changed, locked_outputs(top)):
        return {"git.commit": commit, "git.dirty": "false"}
    outputs = pipeline_outputs(str(Path(cwd or Path.cwd()).resolve()), str(top.resolve()))
    return {"git.commit": commit, "git.dirty": str(not _covered(changed, outputs)).lower()}


def _covered(paths: list[str], outputs: tuple[str, ...]) -> bool:
    """Whether every path is one of ``outputs`` or inside one (both relative, ``/``)."""
    return all(any(p == o or p.startswith(o + "/") for o in outputs) for p in paths)


def locked_outputs(git_top: Path) -> tuple[str, ...]:
    """The outputs the git-tracked ``dvc.lock`` files record, and the lock files themselves.

    DVC writes a stage's ``outs`` (``metrics`` and ``plots`` among them, ``${...}``
    interpolated) to the ``dvc.lock`` beside its ``dvc.yaml`` when the stage runs, so every
    path listed there is something the pipeline wrote. A stage that never ran is missing:
    :func:`pipeline_outputs` (DVC's index) is the complete list.

    Args:
        git_top: the git work tree's top level.

    Returns:
        Paths relative to ``git_top`` (``/``-separated); empty when no lock file is readable.
    """
    import yaml

    listed = subprocess.run(["git", "ls-files", "-z", "--", "dvc.lock", "*/dvc.lock"],
                            capture_output=True, text=True, timeout=30, cwd=git_top).stdout
    found: list[str] = []
    for lock in filter(None, listed.split("\0")):
        try:
            stages = (yaml.safe_load((git_top / lock).read_text()) or {}).get("stages") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            continue  # unreadable: DVC's index decides
        here = Path(lock).parent
        found.append(lock)
        found.extend((here / out["path"]).as_posix() for stage in stages.values()
                     if isinstance(stage, dict) for out in stage.get("outs") or ()
                     if isinstance(out, dict) and "path" in out)
    return tuple(found)


def _changed_paths(porcelain_z: str) -> list[str]:
    """Paths of ``git status --porcelain=v1 -z`` (both sides of a rename or copy)."""
    fields, paths, i = porcelain_z.split("\0"), [], 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if len(entry) < 4:
            continue
        paths.append(entry[3:])
        if entry[0] in "RC":  # "R  new\0old": the old path is the next field
            paths.append(fields[i])
            i += 1
    return paths


@functools.lru_cache(maxsize=8)
def pipeline_outputs(cwd: str, git_top: str) -> tuple[str, ...]:
    """What the DVC pipeline writes, as paths relative to ``git_top`` (``/``-separated).

    Read with DVC's own API (the way ``dvc repro`` reads them, ``${...}`` interpolated from
    ``params.yaml``): every stage's ``outs``, ``metrics`` and ``plots`` in every ``dvc.yaml``
    of the DVC repo around ``cwd``, and the ``dvc.lock`` beside each ``dvc.yaml``.

    Args:
        cwd: a directory inside the DVC repo (absolute).
        git_top: the git work tree's top level (absolute).

    Returns:
        The paths, sorted; empty outside a DVC repo, or when DVC cannot read the pipeline (one
        warning line: :func:`git_state` then counts every changed file).
    """
    from dvc.exceptions import DvcException, NotDvcRepoError
    from dvc.repo import Repo

    found: set[str] = set()
    quiet = logging.getLogger("dvc")  # DVC's handler keeps the stderr of its first import
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        with Repo(cwd) as repo:
            for stage in repo.index.stages:
                found.update(out.fs_path for out in stage.outs)
                path = getattr(stage.dvcfile, "path", "")
                if Path(path).name == "dvc.yaml":
                    found.add(str(Path(path).with_name("dvc.lock")))
    except NotDvcRepoError:
        return ()
    except (DvcException, OSError) as e:
        log.warning("git.dirty counts every changed file: DVC cannot list the pipeline's "
                    "outputs (%s)", error_summary(e))
        return ()
    finally:
        quiet.setLevel(level)
    top = Path(git_top)
    return tuple(sorted(Path(os.path.abspath(p)).relative_to(top).as_posix() for p in found
                        if Path(os.path.abspath(p)).is_relative_to(top)))


WORKSPACE = "workspace"  # the experiment name of `dvc repro` (DVC's own name for it)


def exp_name() -> str:
    """DVC's experiment name (``DVC_EXP_NAME``, set by ``dvc exp run``), else ``workspace``."""
    return os.environ.get("DVC_EXP_NAME") or WORKSPACE


def dvc_tags() -> dict[str, str]:
    """DVC's experiment name (:func:`exp_name`), baseline rev and stage as tags."""
    names = {"DVC_EXP_BASELINE_REV": "dvc.baseline_rev", "DVC_STAGE": "dvc.stage"}
    return {"dvc.exp_name": exp_name(),
            **{tag: os.environ[env] for env, tag in names.items() if os.environ.get(env)}}


def loggable_params(params: Params) -> dict[str, str]:
    """Flattened params (dotted DVC names) as strings, with nothing secret-looking.

    Raises:
        ValueError: a param name looks like a secret (it would be logged in clear).
    """
    flat = flatten(to_dict(params))
    for k in flat:
        if any(w in k.lower() for w in _SECRET_WORDS):
            raise InputError(f"refusing to log param '{k}': looks like a secret")
    return {k: str(v) for k, v in flat.items()}


def _proc_start(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (Linux), None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 (starttime), after "pid (comm)"


def process_tags() -> dict[str, str]:
    """Who owns a run: host, boot id, pid and start time (to tell later whether it is alive)."""
    import socket

    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown"
    return {"proc.host": socket.gethostname(), "proc.boot_id": boot,
            "proc.pid": str(os.getpid()), "proc.start": _proc_start(os.getpid()) or "unknown"}


def owner_dead(tags: dict[str, str], me: dict[str, str]) -> bool:
    """Whether the process that owns a run is known to be gone (same host and boot only)."""
    if tags.get("proc.host") != me["proc.host"] or "proc.pid" not in tags:
        return False  # another machine, or a run without owner tags: cannot tell
    if tags.get("proc.boot_id") != me["proc.boot_id"]:
        return me["proc.boot_id"] != "unknown"  # the machine rebooted since
    start = _proc_start(int(tags["proc.pid"]))
    if start is None:
        return Path("/proc").is_dir()  # without /proc we cannot tell
    return start != tags.get("proc.start")  # the pid was reused by another process
