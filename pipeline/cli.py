"""Shared entry-point plumbing for the DVC stage scripts and ``python -m pipeline``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from pipeline.config import Params, ParamsError, load_params

EXIT_BAD_INPUT = 2
EXIT_TERMINATED = 143  # 128 + SIGTERM


def setup_logging() -> None:
    """Log lines with timestamps to stderr (idempotent)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def stage_main(name: str, run: Callable[[Params], None], argv: list[str] | None = None) -> int:
    """Parse ``--params``, validate the whole file, then call ``run(params)``.

    Invalid params print ONE message naming the key and exit with code 2 before any work.

    Args:
        name: stage name (for ``--help``).
        run: the stage body.
        argv: arguments (default ``sys.argv[1:]``).

    Returns:
        The process exit code.
    """
    parser = argparse.ArgumentParser(prog=f"stages/{name}.py", description=f"DVC stage {name}")
    parser.add_argument("--params", default="params.yaml",
                        help="params file (default: %(default)s)")
    args = parser.parse_args(argv)
    setup_logging()
    from pipeline.tracking import Terminated  # lazy: keeps `--help` and check-params light

    try:
        params = load_params(args.params)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        run(params)
    except _user_errors() as e:
        # Bad input or a stopped run: one clear line, no traceback (the MLflow run is already
        # marked FAILED by the time the exception reaches here).
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except Terminated as e:
        # SIGTERM (e.g. Ctrl-C of dvc repro, a scheduler's preemption): the checkpoint and the
        # KILLED MLflow run are already written; 128 + SIGTERM is the shell's convention.
        print(f"error: Terminated: {e}; rerun `dvc repro` to resume", file=sys.stderr)
        return EXIT_TERMINATED
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that describe bad input or a guarded stop, not a bug."""
    from pipeline.data.shards import ShardError
    from pipeline.data.sources import SourceError
    from pipeline.tracking import TrackingError
    from pipeline.train import NonFiniteLossError

    return (ShardError, SourceError, TrackingError, NonFiniteLossError, FileNotFoundError)
