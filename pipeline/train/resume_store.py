"""Where pretraining's resume state lives: in the MAIN repo, one folder per fingerprint.

``dvc exp run --queue`` and ``--temp`` run the stages in a temporary copy of the repo and delete
it afterwards, so resume state kept in the working directory died with a killed experiment.
DVC sets ``DVC_ROOT`` to the main repo for every stage it runs (workspace, queued and temp
experiments alike); the store is::

    $DVC_ROOT/.checkpoints/pretrain/<first 16 hex digits of the fingerprint>/last.pt

(the working directory when ``DVC_ROOT`` is unset: ``python stages/pretrain.py`` by hand). The
key is the fingerprint that already decides whether a checkpoint may be resumed
(:attr:`pipeline.train.training_input.TrainingInput.fingerprint`: the params that decide the
weights, the image spec, the pretraining set's content, the training code), so the same
experiment queued again finds its checkpoint, and a run with other params never opens it (the
full fingerprint inside ``last.pt`` is still checked on load).
``.checkpoints/`` is git- and dvc-ignored: never copied into an experiment's workspace, never a
DVC output.

Bounded: opening an entry keeps the :data:`KEEP` most recently written ones and deletes the rest
(never the one being opened); ``python -m pipeline clean-checkpoints [--keep N]`` deletes them
by hand.

Abandoned workspaces (:func:`watch_workspace`): ``dvc queue kill --force`` SIGKILLs DVC's
experiment runner but not the stage it started, which goes on training in a workspace DVC
deletes, and later fails on a missing file. In a queued or temp experiment the pretrain stage
watches for that (its parent process gone, or its working directory deleted) and stops itself
with SIGTERM: the checkpoint is written to the store at the next step and the stage ends with one
line that says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

STORE = Path(".checkpoints/pretrain")  # relative to the main repo (DVC_ROOT)
KEY_CHARS = 16  # hex digits of the fingerprint in a folder name (64 bits)
KEEP = 4  # entries kept when one is opened: a few parallel queued experiments + the last one
CHECKPOINT_NAME = "last.pt"


def store_root(root: str | Path | None = None) -> Path:
    """The store folder: ``<root>/.checkpoints/pretrain``, root = ``DVC_ROOT`` or the cwd.

    Relative (``.checkpoints/pretrain``) when the root is the working directory, so log lines
    stay short in the usual ``dvc repro``; absolute in a queued or temp experiment.
    """
    base = Path(root if root is not None else os.environ.get("DVC_ROOT") or ".")
    try:
        if base.resolve() == Path.cwd().resolve():
            return STORE
    except OSError:  # the working directory was deleted: the absolute root still works
        pass
    return base / STORE


def entry_dir(fingerprint: str, root: str | Path | None = None) -> Path:
    """The folder of one fingerprint's ``last.pt`` (not created here)."""
    return store_root(root) / fingerprint[:KEY_CHARS]


def open_entry(fingerprint: str, *, root: str | Path | None = None, keep: int = KEEP,
               maintain: bool = True) -> Path:
    """The checkpoint folder for ``fingerprint``; prunes old ones.

    Args:
        fingerprint: :attr:`pipeline.train.training_input.TrainingInput.fingerprint` of the
            run (64 hex digits).
        root: the main repo (default ``DVC_ROOT``, else the working directory).
        keep: entries kept after pruning, the opened one included (>= 1).
        maintain: prune (rank 0); False only computes the folder (other ranks).

    Returns:
        The folder (created by the first checkpoint write).
    """
    here = entry_dir(fingerprint, root)
    if maintain:
        removed = prune(root=root, keep=max(keep, 1) - 1, protect=here)
        if removed:
            log.info("resume store: removed %d old checkpoint folder(s) (%s kept)", len(removed),
                     keep)
    return here


def entries(root: str | Path | None = None) -> list[Path]:
    """Every fingerprint folder of the store, most recently written first."""
    store = store_root(root)
    if not store.is_dir():
        return []

    def written(d: Path) -> float:
        f = d / CHECKPOINT_NAME
        return (f if f.exists() else d).stat().st_mtime

    found = [d for d in store.iterdir() if d.is_dir() and not d.is_symlink()
             and len(d.name) == KEY_CHARS and all(c in "0123456789abcdef" for c in d.name)]
    return sorted(found, key=lambda d: (-written(d), d.name))


def prune(*, root: str | Path | None = None, keep: int = KEEP,
          protect: Path | None = None) -> list[Path]:
    """Delete all but the ``keep`` most recently written entries (never ``protect``).

    Returns:
        The folders deleted.
    """
    removed = []
    others = [d for d in entries(root) if protect is None or d.name != protect.name]
    for d in others[max(keep, 0):]:
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def clean_main(*, keep: int = 0, root: str | Path | None = None) -> int:
    """``python -m pipeline clean-checkpoints [--keep N]``: delete old resume state.

    Args:
        keep: entries kept (the most recently written); 0 deletes all.
        root: the main repo (default ``DVC_ROOT``, else the working directory).

    Returns:
        Exit code 0 (1 with an ``error:`` line when ``keep`` is negative).
    """
    if keep < 0:
        print(f"error: clean-checkpoints: --keep must be >= 0, got {keep}", file=sys.stderr)
        return 1
    store = store_root(root)
    removed = prune(root=root, keep=keep)
    kept = len(entries(root))
    print(f"{store}: removed {len(removed)} checkpoint folder(s), kept {kept}")
    return 0


class WorkspaceWatch:
    """Why the stage stopped itself (:attr:`reason`), set by :func:`watch_workspace`.

    Args:
        parent: DVC's runner, the parent process when the watch began (None = not watched).
        cwd: the experiment's workspace.
    """

    def __init__(self, parent: int | None = None, cwd: str = "") -> None:
        self.reason: str | None = None
        self.parent, self.cwd = parent, cwd

    def abandoned(self) -> bool:
        """Check now: True (and :attr:`reason` set) once DVC abandoned the workspace.

        The engine asks this when the data fails between two steps: DVC may delete the
        workspace's shards before the periodic check's SIGTERM arrives.
        """
        if self.reason is None and self.parent is not None:
            if os.getppid() != self.parent:
                self.reason = (f"DVC's experiment runner (pid {self.parent}) is gone, so its "
                               f"workspace {self.cwd} will be deleted (`dvc queue kill --force`?)")
            elif not os.path.isdir(self.cwd):
                self.reason = f"the experiment's workspace {self.cwd} was deleted"
        return self.reason is not None


def in_experiment_workspace() -> bool:
    """Whether this process runs in a queued or temp experiment's copy of the repo.

    DVC sets ``DVC_ROOT`` to the main repo; the working directory is elsewhere only in an
    experiment's temporary workspace.
    """
    root = os.environ.get("DVC_ROOT")
    try:
        return bool(root) and Path(root).resolve() != Path.cwd().resolve()
    except OSError:
        return bool(root)


@contextlib.contextmanager
def watch_workspace(interval_s: float = 1.0) -> Iterator[WorkspaceWatch]:
    """In an experiment workspace: SIGTERM this process once DVC abandoned it.

    Abandoned = the parent process (DVC's runner) is gone, or the working directory was
    deleted. SIGTERM goes through the stage's usual path (a checkpoint at the next step, one
    line, exit 143); the caller adds :attr:`WorkspaceWatch.reason` to that line. Outside an
    experiment workspace (``dvc repro``, a script run by hand, ``nohup``) nothing is watched.

    Args:
        interval_s: seconds between two checks.

    Yields:
        The watch; ``reason`` stays None unless the process stopped itself.
    """
    if not in_experiment_workspace():
        yield WorkspaceWatch()
        return
    watch = WorkspaceWatch(os.getppid(), os.getcwd())
    done = threading.Event()

    def check() -> None:
        while not done.wait(interval_s):
            if watch.abandoned():
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=check, name="workspace-watch", daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        done.set()
