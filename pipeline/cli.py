"""Shared entry-point plumbing for the DVC stage scripts and ``python -m pipeline``.

A stage script is ``from pipeline.cli import stage_entry`` + a ``run(params)`` function whose
imports are local, + ``stage_entry("<name>", run)``: the signal handlers
(:mod:`pipeline.signals`) are installed before any heavy import, so a SIGTERM or SIGINT at any
point of the stage gives one ``error:`` line and exit 128 + signum (143 / 130).

Every failure we can name ends in ONE ``error: <Type>: <what>`` line and a non-zero exit, in
every stage (:func:`error_line`): the project's own error types, a DataLoader worker that died
(named signal, whether it looks like the out-of-memory killer), and a ``ValueError``,
``RuntimeError``, ``FloatingPointError`` or ``OSError`` raised by the project's own code (its
input checks). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from pipeline import signals

if TYPE_CHECKING:
    from pipeline.config import Params

EXIT_BAD_INPUT = 2
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_FAILED = 1
_OWN_CODE = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d)
                  + os.sep for d in ("pipeline", "stages"))
# raised by our own input checks; raised anywhere else they are bugs (traceback kept)
_OWN_CHECK_TYPES = (ValueError, RuntimeError, FloatingPointError, OSError)
_BUG_TYPES = (AssertionError, NotImplementedError, RecursionError)

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
        print(f"error: Terminated: received {signals.signal_name(e.signum)}; {rerun_hint()}",
              file=sys.stderr)
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
        print(f"error: Terminated: {msg}; {rerun_hint()}", file=sys.stderr)
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
        # name the file as load_params does: "params.yaml: 'moco.K' = ...", not "params: ..."
        print(f"error: {args.params}: {str(e).removeprefix('params: ')}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:
        line = error_line(e)
        if line is None:
            raise
        # Bad input or a guarded stop: one clear line, no traceback (the MLflow run is already
        # marked FAILED by the time the exception reaches here).
        print(f"error: {line}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def rerun_hint() -> str:
    """How to continue after a stop: the same experiment again inside ``dvc exp run``."""
    if os.environ.get("DVC_EXP_NAME"):
        return ("run the experiment again with the same params (`dvc exp run`, `--queue` or "
                "`--temp`) to continue")
    return "rerun `dvc repro` to continue"


def error_line(e: BaseException) -> str | None:
    """``<Type>: <what>`` on one line for a failure we can name, None for a bug.

    Named: the project's error types (:func:`_user_errors`), a dead DataLoader worker
    (:func:`pipeline.data.workers.worker_death`), and the built-in error types of input checks
    (:data:`_OWN_CHECK_TYPES`) when raised by the project's own code (the innermost frame of the
    traceback, or of a DataLoader worker's re-raised traceback, lies in ``pipeline/`` or
    ``stages/``).
    """
    from pipeline.data.workers import worker_death

    if isinstance(e, _user_errors()):
        return f"{type(e).__name__}: {_one_line(str(e))}"
    died = worker_death(e)
    if died is not None:
        return f"{type(died).__name__}: {died}"
    if isinstance(e, _BUG_TYPES) or not isinstance(e, _OWN_CHECK_TYPES):
        return None
    text = str(e)
    worker = re.match(r"Caught (\w+) in DataLoader worker process \d+\.", text)
    if worker:  # PyTorch re-raises a worker's exception with its traceback as the message
        files = re.findall(r'File "([^"]+)"', text)
        if not files or not _own_file(files[-1]):
            return None
        return f"{worker.group(1)}: {_one_line(text.rstrip().splitlines()[-1].split(': ', 1)[-1])}"
    tb = e.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    if not _own_file(tb.tb_frame.f_code.co_filename):
        return None
    return f"{type(e).__name__}: {_one_line(text)}"


def _own_file(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_OWN_CODE)


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text.strip())


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that describe bad input or a guarded stop, not a bug."""
    from pipeline.data.remote import RemoteError
    from pipeline.data.shards import ShardError
    from pipeline.data.sources import SourceError
    from pipeline.tracking import TrackingError
    from pipeline.train.checkpoint import NonFiniteError
    from pipeline.train.plan import PlanError

    return (ShardError, SourceError, TrackingError, NonFiniteError, PlanError, RemoteError,
            FileNotFoundError)
