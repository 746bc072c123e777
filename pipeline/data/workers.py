"""A DataLoader worker that died: from PyTorch's ``RuntimeError`` text to one named failure.

When a worker process dies, PyTorch raises a ``RuntimeError`` in the main process, either from
its SIGCHLD handler (at whatever line the main process is running)::

    DataLoader worker (pid 4242) is killed by signal: Killed.

or while waiting for a batch::

    DataLoader worker (pid(s) 4242) exited unexpectedly

:func:`worker_death` recognises both (and the exit status of the worker processes, when the
loader's iterator is at hand) and returns a :class:`LoaderWorkerError` that names the pid, the
signal and whether it looks like the out-of-memory killer (which sends SIGKILL). The stage
entry point prints it as one ``error:`` line; the training engine adds the checkpoint step.

This module imports only the standard library.
"""

from __future__ import annotations

import inspect
import re
import signal
from collections.abc import Iterable
from typing import Any

from pipeline.errors import PipelineError

_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: ([^.]+)\.")
_EXITED = re.compile(r"DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly")
_EXIT_CODE = re.compile(r"DataLoader worker \(pid (\d+)\) exited unexpectedly with exit code "
                        r"(-?\d+)")
# strsignal() text (what PyTorch prints) -> signal number, e.g. "Killed" -> SIGKILL
_BY_TEXT = {signal.strsignal(s): int(s) for s in signal.Signals if signal.strsignal(s)}


class LoaderWorkerError(PipelineError, RuntimeError):
    """A DataLoader worker process died (killed by a signal, or exited).

    Args:
        pid: the worker's process id (None when PyTorch did not say).
        signum: the signal that killed it (None when it exited or is unknown).
        exit_code: its exit status when it exited without a signal.
        where: what the caller adds (e.g. the checkpoint to resume from).
    """

    def __init__(self, pid: int | None, signum: int | None, exit_code: int | None = None,
                 where: str = "") -> None:
        self.pid, self.signum, self.exit_code, self.where = pid, signum, exit_code, where
        super().__init__(self._text())

    @property
    def signal_name(self) -> str:
        """``SIGKILL``, ``SIGSEGV``, ... (``"?"`` when unknown)."""
        if self.signum is None:
            return "?"
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return str(self.signum)

    def _text(self) -> str:
        who = f"DataLoader worker (pid {self.pid})" if self.pid else "a DataLoader worker"
        if self.signum == signal.SIGKILL:
            what = (f"{who} was killed by SIGKILL, as the out-of-memory killer does (see "
                    "`dmesg` or the cgroup's memory.events; fewer loader workers, a "
                    "smaller batch or smaller images need less memory)")
        elif self.signum == signal.SIGBUS:
            what = (f"{who} was killed by SIGBUS (not the out-of-memory killer, which sends "
                    "SIGKILL): usually shared memory (/dev/shm) is full")
        elif self.signum is not None:
            what = (f"{who} was killed by {self.signal_name} (not the out-of-memory killer, "
                    "which sends SIGKILL)")
        elif self.exit_code is not None:
            what = f"{who} exited unexpectedly with exit code {self.exit_code}"
        else:
            what = f"{who} exited unexpectedly"
        return f"{what}; {self.where}" if self.where else what

    def with_where(self, where: str) -> LoaderWorkerError:
        """The same death with ``where`` (e.g. the checkpoint step) appended to the message."""
        return LoaderWorkerError(self.pid, self.signum, self.exit_code, where)


def worker_death(e: BaseException, workers: Iterable[Any] | None = None
                 ) -> LoaderWorkerError | None:
    """The worker death behind ``e`` (or an exception it was raised from), else None.

    Args:
        e: an exception caught in the main process.
        workers: the DataLoader iterator's worker processes (``multiprocessing.Process``), when
            at hand: a negative ``exitcode`` there names the signal PyTorch's message omits.

    Returns:
        A :class:`LoaderWorkerError`, or None when ``e`` is not a worker death.
    """
    if isinstance(e, LoaderWorkerError):
        return e
    if isinstance(e, (OSError, EOFError)) and workers is not None:
        # a worker killed while it hands a batch over: the batch's shared memory is passed by
        # file descriptor through the worker's socket, which died with it
        return dead_worker(workers)
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        text = str(cur)
        m = _KILLED.search(text)
        if m:
            return LoaderWorkerError(int(m.group(1)), _BY_TEXT.get(m.group(2).strip()))
        m = _EXIT_CODE.search(text)
        if m:
            return LoaderWorkerError(int(m.group(1)), None, int(m.group(2)))
        m = _EXITED.search(text)
        if m:
            pids = [int(p) for p in re.findall(r"\d+", m.group(1))]
            return _from_exit_codes(pids, workers)
        cur = cur.__cause__ or cur.__context__
    return None


def dead_worker(workers: Iterable[Any]) -> LoaderWorkerError | None:
    """The first worker process that has exited with a failure, else None.

    Args:
        workers: ``multiprocessing.Process`` objects (a DataLoader iterator's ``_workers``);
            each is joined for at most 0.1 s, so one that just died is reaped and its exit
            code read.

    Returns:
        A :class:`LoaderWorkerError` naming its pid and signal (or exit code), or None.
    """
    for w in workers:
        w.join(timeout=0.1)
        if (died := _exited(w.pid, w.exitcode)) is not None:
            return died
    return None


def _exited(pid: int | None, code: Any) -> LoaderWorkerError | None:
    """A worker's death from its exit code (negative: the signal), or None (alive, or 0)."""
    if isinstance(code, int) and code < 0:
        return LoaderWorkerError(pid, -code)
    if isinstance(code, int) and code > 0:
        return LoaderWorkerError(pid, None, code)
    return None


def _from_exit_codes(pids: list[int], workers: Iterable[Any] | None) -> LoaderWorkerError:
    """A death named by pid, the signal read from the worker process's exit code when known."""
    codes = {getattr(w, "pid", None): getattr(w, "exitcode", None) for w in workers or ()}
    for pid in pids:
        if (died := _exited(pid, codes.get(pid))) is not None:
            return died
    return LoaderWorkerError(pids[0] if pids else None, None)


def shut_down(batches: Iterable[Any]) -> None:
    """Stop a DataLoader iterator's worker processes now, whatever state they are in.

    An iterator left to the garbage collector is shut down in its ``__del__``, when the last
    reference goes (e.g. when the stage drops the exception that holds the training frame),
    after the stage's error line is printed. When one of its workers was killed
    (a signal to the whole process group), PyTorch's SIGCHLD handler raises inside that
    ``__del__`` and Python prints an "Exception ignored" traceback after the stage's one
    ``error:`` line. Shutting down here, once, marks the iterator shut down, so ``__del__``
    does nothing. A worker death seen while shutting down is dropped: the batches it owed are
    no longer wanted. This relies on ``_shutdown_workers``, the method PyTorch's own
    ``__del__`` calls; an iterator without it (no worker processes) is left alone. A generator
    (the train loader's ``iter``, which wraps PyTorch's iterator) is closed: its ``finally``
    shuts the iterator it wraps down the same way.

    Args:
        batches: the iterator returned by ``iter(DataLoader)``.

    Raises:
        RuntimeError: any error of the shutdown other than a worker death.
    """
    if inspect.isgenerator(batches):  # a wrapper such as the train loader's: its finally
        batches.close()               # shuts its DataLoader iterator down
        return
    stop = getattr(batches, "_shutdown_workers", None)
    if stop is None:
        return
    try:
        stop()
    except RuntimeError as e:
        if worker_death(e) is None:
            raise
