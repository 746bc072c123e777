"""Shared entry-point plumbing for the DVC stage scripts and ``python -m pipeline``.

A stage script is ``from pipeline.cli import stage_entry`` + a ``run(params)`` function whose
imports are local, + ``stage_entry("<name>", run)``: the signal handlers
(:mod:`pipeline.signals`) are installed before any heavy import, so a SIGTERM or SIGINT at any
point of the stage gives one ``error:`` line and exit 128 + signum (143 / 130).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from pipeline import signals

if TYPE_CHECKING:
    from pipeline.config import Params

EXIT_BAD_INPUT = 2
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_INTERRUPTED = 130  # 128 + SIGINT

log = logging.getLogger(__name__)


def setup_logging() -> None:
    """Log lines with timestamps to stderr (idempotent)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def stage_entry(name: str, run: Callable[[Params], None]) -> NoReturn:
    """The whole life of a stage process: signals, :func:`stage_main`, the last signal check.

    Args:
        name: stage name.
        run: the stage body (imports what it needs itself).

    Raises:
        SystemExit: always, with the stage's exit code (0, 1, 2, 128 + signum).
    """
    try:
        signals.install()
    except signals.Terminated as e:  # arrived while the handlers were being installed
        print(f"error: Terminated: received {signals.signal_name(e.signum)}; rerun `dvc repro` "
              "to continue", file=sys.stderr)
        sys.exit(e.exit_code)
    code = stage_main(name, run)
    code, late = signals.finish(code)
    if late is not None:
        print(f"error: Terminated: received {signals.signal_name(late)} as the stage ended; its "
              "MLflow run is marked KILLED; rerun `dvc repro`", file=sys.stderr)
    sys.exit(code)


def stage_main(name: str, run: Callable[[Params], None], argv: list[str] | None = None) -> int:
    """Parse ``--params``, validate the whole file, then call ``run(params)``.

    Invalid params print ONE message naming the key and exit with code 2 before any work (also
    a :class:`~pipeline.config.ParamsError` from the stage body: a param that only the data can
    refute, such as ``embed.pool_grid`` against the shards' image size). A
    :class:`~pipeline.signals.Terminated` (SIGTERM/SIGINT) prints one line and returns
    128 + signum.

    Args:
        name: stage name (for ``--help``).
        run: the stage body.
        argv: arguments (default ``sys.argv[1:]``).

    Returns:
        The process exit code.
    """
    try:
        return _stage_main(name, run, argv)
    except signals.Terminated as e:
        # SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C): a checkpoint (pretrain) and
        # the KILLED MLflow run are already written; 128 + signum is the shell's convention.
        msg = str(e) or f"received {signals.signal_name(e.signum)}"
        print(f"error: Terminated: {msg}; rerun `dvc repro` to continue", file=sys.stderr)
        return e.exit_code


def _stage_main(name: str, run: Callable[[Params], None], argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog=f"stages/{name}.py", description=f"DVC stage {name}")
    parser.add_argument("--params", default="params.yaml",
                        help="params file (default: %(default)s)")
    args = parser.parse_args(argv)
    setup_logging()
    from pipeline.config import ParamsError, load_params

    try:
        params = load_params(args.params)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        run(params)
    except ParamsError as e:  # a param that only the data can refute (checked before any work)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        # Bad input or a guarded stop: one clear line, no traceback (the MLflow run is already
        # marked FAILED by the time the exception reaches here).
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that describe bad input or a guarded stop, not a bug."""
    from pipeline.data.shards import ShardError
    from pipeline.data.sources import SourceError
    from pipeline.tracking import TrackingError
    from pipeline.train.engine import NonFiniteLossError
    from pipeline.train.plan import PlanError

    return (ShardError, SourceError, TrackingError, NonFiniteLossError, PlanError,
            FileNotFoundError)
