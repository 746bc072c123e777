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

A worker whose batch does not fit in shared memory (``/dev/shm`` full: Docker's default is
64 MiB, pytorch/pytorch#5040) lives on: PyTorch raises in the worker's queue thread, which
prints a traceback and drops the batch, and the main process would wait for it forever. The
loaders' queue (:class:`pipeline.data.readers.ReportingQueue`) sends that error in the batch's
place, the main process re-raises it, and :func:`worker_death` names it a
:class:`SharedMemoryError`: ``/dev/shm`` and what to do.

This module imports only the standard library.
"""

from __future__ import annotations

import inspect
import os
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
# PyTorch's failure to create a tensor's shared memory file (</torch_<pid>_...>) for lack of
# room, e.g. ``unable to allocate shared memory(shm) for file </torch_52_3710846093_0>: No space
# left on device (28)`` (2.x), ``unable to write to file </torch_18_1594147285>: No space left
# on device`` (1.x)
_SHM_FULL = re.compile(r"</torch_[^>]*>.*No space left on device")
_WORKER_ID = re.compile(r"Caught \w+ in DataLoader worker process (\d+)\.")
SHM_DIR = "/dev/shm"  # where POSIX shared memory (shm_open, sem_open) lives on Linux
SHM_ADVICE = ("give it more room (`docker run --shm-size=1g ...`, or `mount -o remount,size=1G "
              "/dev/shm` as root)")


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
                    f"SIGKILL): usually shared memory ({SHM_DIR}) is full; {SHM_ADVICE}")
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


class SharedMemoryError(LoaderWorkerError):
    """``/dev/shm`` had no room for a batch a DataLoader worker hands over, or for the loader.

    The worker (or the main process, creating the loader's queues, whose semaphores live in
    ``/dev/shm`` too) did not die of it: the batch was lost, and the loader stopped instead of
    waiting for it.

    Args:
        pid: the worker's process id (None: the main process, or not known).
        workers_key: the param that sets the number of loader workers, named in the advice
            (``pretrain.num_workers``); None when the stage has no such param.
        where: what the caller adds (e.g. the checkpoint to resume from).
        space: ``(free, total)`` bytes of ``/dev/shm``; None = measured now
            (:func:`shm_space`).
        item: what did not fit (``"a batch"``; ``"the queues"`` when the loader starts).
    """

    def __init__(self, pid: int | None, workers_key: str | None = None, where: str = "",
                 space: tuple[int, int] | None = None, item: str = "a batch") -> None:
        self.workers_key, self.item = workers_key, item
        self.space = shm_space() if space is None else space
        super().__init__(pid, None, None, where)

    def _text(self) -> str:
        who = f"DataLoader worker (pid {self.pid})" if self.pid else "the DataLoader"
        free, total = (_size(b) for b in self.space)
        what = (f"shared memory {SHM_DIR} (size {total}, {free} free now) had no room for "
                f"{self.item} of {who}; {SHM_ADVICE}")
        if self.workers_key:
            what += f", or set `{self.workers_key}: 0` (no loader worker processes)"
        return f"{what}; {self.where}" if self.where else what

    def with_where(self, where: str) -> SharedMemoryError:
        """The same failure with ``where`` (e.g. the checkpoint step) appended to the message."""
        return SharedMemoryError(self.pid, self.workers_key, where, self.space, self.item)

    def with_workers_key(self, key: str) -> SharedMemoryError:
        """The same failure, advising ``key: 0`` too (the stage's number-of-workers param)."""
        return SharedMemoryError(self.pid, key, self.where, self.space, self.item)


def shm_space(path: str = SHM_DIR) -> tuple[int, int]:
    """``(free, total)`` bytes of the filesystem at ``path`` (``(0, 0)`` when it cannot be read).

    Free counts the blocks an unprivileged process may use (``statvfs``'s ``f_bavail``).
    """
    try:
        st = os.statvfs(path)
    except OSError:
        return 0, 0
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _size(n: int) -> str:
    """``n`` bytes as ``64.0 MiB`` (from 1 MiB up) or ``128 KiB``."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def worker_death(e: BaseException, workers: Iterable[Any] | None = None
                 ) -> LoaderWorkerError | None:
    """The worker death behind ``e`` (or an exception it was raised from), else None.

    A batch that did not fit in ``/dev/shm`` counts: the worker is alive, but its batch is lost
    (PyTorch's ``RuntimeError``, re-raised from the worker by the loaders' queue,
    :class:`pipeline.data.readers.SizedLoader`).

    Args:
        e: an exception caught in the main process.
        workers: the DataLoader iterator's worker processes (``multiprocessing.Process``), when
            at hand: a negative ``exitcode`` there names the signal PyTorch's message omits, and
            the pid of the worker whose batch did not fit in ``/dev/shm``.

    Returns:
        A :class:`LoaderWorkerError` (a :class:`SharedMemoryError` for ``/dev/shm``), or None
        when ``e`` is not a worker death.
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
        if _SHM_FULL.search(text):
            return SharedMemoryError(_worker_pid(text, workers))
        cur = cur.__cause__ or cur.__context__
    return None


def _worker_pid(text: str, workers: Iterable[Any] | None) -> int | None:
    """The pid of the worker PyTorch names by number in ``text`` (``Caught ... process 0.``)."""
    m = _WORKER_ID.search(text)
    procs = list(workers or ())
    if m is None or int(m.group(1)) >= len(procs):
        return None
    return getattr(procs[int(m.group(1))], "pid", None)


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
