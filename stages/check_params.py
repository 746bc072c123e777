"""DVC stage ``check_params``: validate the whole params file before any other stage runs.

DVC deletes a stage's outputs right before running it, so a typo caught inside a stage would
already have cost that stage's previous outputs. This stage runs first and writes a
content-stable stamp (the same bytes for every valid file) that every other stage depends on:
a bad file stops ``dvc repro`` before any other stage is touched, and a good change still
reruns only the stages whose own params changed.
"""

from __future__ import annotations

import argparse
import sys

from pipeline import signals
from pipeline.cli import EXIT_BAD_INPUT, setup_logging

STAMP = {"stage": "check_params", "run_id": None, "params": "valid"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stages/check_params.py")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--stamp", default="runs/check_params.json")
    args = parser.parse_args(argv)
    setup_logging()
    from pipeline.atomic import write_json
    from pipeline.config import ParamsError, check_params_file

    try:
        check_params_file(args.params)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    write_json(args.stamp, STAMP)
    return 0


if __name__ == "__main__":
    signals.install()
    try:
        rc = main()
    except signals.Terminated as e:
        print(f"error: Terminated: {e}", file=sys.stderr)
        rc = e.exit_code
    code, _ = signals.finish(rc)
    sys.exit(code)
