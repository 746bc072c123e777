"""SIGTERM and SIGINT during training: finish the step, checkpoint, then stop with one line."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """Within the block, SIGTERM/SIGINT set a :class:`StopFlag` instead of interrupting.

    The previous handlers (e.g. the stage's "raise Terminated") are restored on exit. Outside the
    main thread (where handlers cannot be installed) the flag simply never rises.

    Yields:
        The flag.
    """
    flag = StopFlag()
    previous: dict[int, Any] = {}
    try:
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, flag)
    except ValueError:  # not the main thread
        pass
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
