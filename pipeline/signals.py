"""SIGTERM and SIGINT in a stage: one ``error:`` line and exit 128 + signum, first line to last.

A stage script calls :func:`install` before anything else (its heavy imports happen inside
:func:`pipeline.cli.stage_main`), so a signal during imports, params loading, MLflow set-up, the
work itself or the final bookkeeping raises :class:`Terminated` in the main thread.

Inside the training loop (:func:`stop_on_signals`) a signal only sets a :class:`StopFlag`: the
engine finishes the step, writes a checkpoint, then raises :class:`Terminated` itself; the
previous handlers come back afterwards.

The last window: once a stage's MLflow run is recorded FINISHED, :func:`hold` makes later signals
*pending* instead of raising; the entry point's very last check (:func:`finish`) turns a pending
signal into a KILLED run, one ``error:`` line and exit 128 + signum. So the exit code and the
MLflow status always agree: exit 0 only with a FINISHED run, never a FINISHED run with a failure.

This module imports only the standard library: it must be cheap to import first.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT)

# hold: record signals instead of raising; pending: first signal recorded while held; raised:
# the signal already raised as Terminated (later ones are held: clean-up is not interrupted);
# on_late: callbacks for a signal held after the stage's run was recorded FINISHED; entry: the
# process is a stage entry point (install() was called), so hold() applies.
_state: dict[str, Any] = {}


def _reset(entry: bool) -> None:
    _state.update(hold=False, pending=None, raised=None, on_late=[], entry=entry)


_reset(False)


class Terminated(BaseException):  # noqa: N818 - the name the engine and the CLI already use
    """The process received SIGTERM or SIGINT (raised in the main thread).

    A ``BaseException`` so that ``except Exception`` blocks in libraries do not swallow it.

    Args:
        message: what was interrupted (and whether a checkpoint was written).
        signum: the signal received; the process exits with ``128 + signum`` (143 for SIGTERM,
            130 for SIGINT), the shell's convention.
    """

    def __init__(self, message: str = "", signum: int = signal.SIGTERM) -> None:
        super().__init__(message)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        """``128 + signum``."""
        return 128 + self.signum


def signal_name(signum: int) -> str:
    """``SIGTERM``, ``SIGINT``, ... (the number for an unknown signal)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _handler(signum: int, frame: Any) -> None:
    if _state["hold"]:
        if _state["pending"] is None:
            _state["pending"] = signum
        return
    _state.update(hold=True, raised=signum)  # one-shot: clean-up runs to its end
    raise Terminated(f"received {signal_name(signum)}", signum=signum)


def install() -> None:
    """Turn SIGTERM and SIGINT into :class:`Terminated` for the whole process (main thread).

    Called first by a stage entry point (:func:`pipeline.cli.stage_entry`).
    """
    _reset(True)
    for s in HANDLED:
        signal.signal(s, _handler)


def installed() -> bool:
    """Whether this module's handler is the current SIGTERM handler."""
    return signal.getsignal(signal.SIGTERM) is _handler


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """SIGTERM/SIGINT raise :class:`Terminated` inside the block (a no-op under :func:`install`).

    For library use outside a stage entry point (tests, notebooks); previous handlers are
    restored afterwards. Outside the main thread nothing is installed.
    """
    if installed():
        yield
        return
    try:
        previous = {s: signal.signal(s, _handler) for s in HANDLED}
    except ValueError:  # not the main thread
        yield
        return
    _reset(False)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _reset(False)


def hold(on_late: Callable[[int], None] | None = None) -> None:
    """In a stage entry point: from now on a signal is recorded, not raised.

    :func:`finish` acts on it. Outside an entry point (no :func:`install`) this does nothing.

    Args:
        on_late: called with the signal number by :func:`finish` when a signal arrived while
            held (e.g. mark the just-FINISHED MLflow run KILLED).
    """
    if not _state["entry"]:
        return
    _state["hold"] = True
    if on_late is not None:
        _state["on_late"].append(on_late)


def finish(code: int) -> tuple[int, int | None]:
    """The stage's last step: ignore further signals, then act on one that arrived while held.

    Args:
        code: the exit code the stage decided on.

    Returns:
        ``(exit code, signum)``: ``(128 + signum, signum)`` when a signal was pending (after
        running the ``on_late`` callbacks), else ``(code, None)``.
    """
    for s in HANDLED:
        signal.signal(s, signal.SIG_IGN)
    signum = _state["pending"]
    if signum is None or _state["raised"] is not None:
        return code, None  # no signal, or one already raised and reported
    for cb in _state["on_late"]:
        cb(signum)
    return 128 + signum, signum


class StopFlag:
    """Records the first stop signal received; the loop checks :attr:`signum` between steps."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        """The signal handler: remember ``signum`` (the first one wins)."""
        if self.signum is None:
            self.signum = signum

    @property
    def raised(self) -> bool:
        """Whether a stop signal arrived."""
        return self.signum is not None


@contextlib.contextmanager
def stop_on_signals(flag: StopFlag | None = None) -> Iterator[StopFlag]:
    """Within the block, SIGTERM/SIGINT set a :class:`StopFlag` instead of interrupting.

    The previous handlers (e.g. the stage's "raise Terminated") are restored on exit. Outside the
    main thread (where handlers cannot be installed) the flag simply never rises.

    Args:
        flag: the flag to set (a new one when None).

    Yields:
        The flag.
    """
    flag = StopFlag() if flag is None else flag
    previous: dict[int, Any] = {}
    try:
        for sig in HANDLED:
            previous[sig] = signal.signal(sig, flag)
    except ValueError:  # not the main thread
        pass
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
