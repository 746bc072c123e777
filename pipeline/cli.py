"""Shared entry-point plumbing for the DVC stage scripts and ``python -m pipeline``.

A stage script is ``from pipeline.cli import stage_entry`` + a ``run(params)`` function whose
imports are local, + ``stage_entry("<name>", run)``: the signal handlers
(:mod:`pipeline.signals`) are installed before any heavy import, so a SIGTERM or SIGINT at any
point of the stage gives one ``error:`` line and exit 128 + signum (143 / 130).

Every failure we can name ends in ONE ``error: <Type>: <what>`` line and a non-zero exit, in
every stage (:func:`error_line`): a :class:`~pipeline.errors.PipelineError` (the project's
own error types: bad input, an unusable backend, a guarded stop), a DataLoader worker that died
(named signal, whether it looks like the out-of-memory killer), a missing file. The type
decides, not where it was raised: anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from pipeline import signals
from pipeline.errors import PipelineError

if TYPE_CHECKING:
    from pipeline.config import Params

EXIT_BAD_INPUT = 2
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_FAILED = 1

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
    # What the stage left in reference cycles (a failed loader's iterator, held by the frames of
    # the traceback that was handled) is finalised here, while stderr is still open, rather
    # than at interpreter teardown: there a finaliser that writes to a closed file, called from
    # torch's C++, aborts the process (SIGABRT after the one error line, seen once in CI-like
    # runs when a loader worker was SIGKILLed)
    gc.collect()
    code, late = signals.finish(code)
    if late is not None:
        print(f"error: Terminated: received {signals.signal_name(late)} as the stage ended; its "
              "MLflow run is marked KILLED; rerun `dvc repro`", file=sys.stderr)
    sys.exit(code)


def stage_main(name: str, run: Callable[[Params], None], argv: list[str] | None = None) -> int:
    """Parse ``--params``, validate the whole file, call ``run(params)``, check the inputs.

    Invalid params print ONE message naming the key and exit with code 2 before any work (also
    a :class:`~pipeline.config.ParamsError` from the stage body: a param that only the data can
    refute, such as ``embed.pool_grid`` against the shards' image size). A
    :class:`~pipeline.signals.Terminated` (SIGTERM/SIGINT) prints one line and returns
    128 + signum. A param (listed in ``dvc.yaml``) or a code file that changed while the stage
    ran is one ``error: InputsChanged`` line and exit 1 (:mod:`pipeline.stage_inputs`): DVC
    records a stage's params and deps when it ends, so it would record the new ones against
    outputs computed from the old.

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
    from pipeline.stage_inputs import snapshot, watching

    try:
        inputs = snapshot(name, args.params)  # before the read: an edit in between is refused
        params = load_params(args.params)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        with watching(inputs):  # MLflow and the registry check it before they record
            run(params)
        inputs.check()  # what DVC is about to record is what the stage read (dvc#11058)
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

    Named, by type alone: a :class:`~pipeline.errors.PipelineError` (bad input the code
    refused, a backend that cannot be used, a guarded stop), also when PyTorch re-raises one from
    a DataLoader worker (its message is then the worker's traceback: the last line is kept), a
    dead DataLoader worker (:func:`pipeline.data.workers.worker_death`), and a missing file.
    Any other exception is a bug: None, and the caller lets the traceback through.
    """
    from pipeline.data.workers import worker_death

    died = worker_death(e)
    if died is not None:
        return f"{type(died).__name__}: {died}"
    if isinstance(e, FileNotFoundError):
        return f"{type(e).__name__}: {_one_line(str(e))}"
    if not isinstance(e, PipelineError):
        return None
    text = str(e)
    worker = re.match(r"Caught (\w+) in DataLoader worker process \d+\.", text)
    if worker:  # PyTorch re-raises a worker's exception with its traceback as the message
        return f"{worker.group(1)}: {_one_line(text.rstrip().splitlines()[-1].split(': ', 1)[-1])}"
    return f"{type(e).__name__}: {_one_line(text)}"


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text.strip())
