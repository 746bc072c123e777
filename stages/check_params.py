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
from pathlib import Path

from pipeline import signals
from pipeline.cli import EXIT_BAD_INPUT, setup_logging

STAMP = {"stage": "check_params", "run_id": None, "params": "valid"}


def check_outputs_inside(shards_dir: str, repo: Path) -> None:
    """Under DVC: ``data.shards_dir``, a ``build_shards`` output, must lie inside the repository.

    DVC 3 refuses an output outside the repository only after the stage ran (``Saving cached
    external output ... is not supported``). A URL is read in place, never built; by hand
    (``python stages/...``) any path works.

    Args:
        shards_dir: ``data.shards_dir``.
        repo: the stage's working directory (the repository or an experiment's copy of it).

    Raises:
        ParamsError: ``shards_dir`` resolves outside ``repo`` (names the key).
    """
    from pipeline.data.remote import is_url
    from pipeline.errors import ParamsError

    if is_url(shards_dir) or (repo / shards_dir).resolve().is_relative_to(repo.resolve()):
        return
    raise ParamsError(f"params: 'data.shards_dir' = {shards_dir!r} is outside the repository "
                      f"{repo}: DVC keeps stage outputs inside it (write a path in the "
                      "repository, or name existing shards in data.pretrain_shards)",
                      "data.shards_dir")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stages/check_params.py")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--stamp", default="runs/check_params.json")
    args = parser.parse_args(argv)
    setup_logging()
    import os

    from pipeline.atomic import write_json
    from pipeline.config import ParamsError, check_params_file
    from pipeline.stage_inputs import InputsChanged, snapshot

    try:
        inputs = snapshot("check_params", args.params)  # params.yaml is a dep: its bytes
        params = check_params_file(args.params)
        if os.environ.get("DVC_ROOT"):  # run by DVC: its outputs must stay in the repository
            check_outputs_inside(params.data.shards_dir, Path.cwd())
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    write_json(args.stamp, STAMP)
    try:
        inputs.check()  # DVC records params.yaml's hash as the file checked (dvc#11058)
    except InputsChanged as e:
        print(f"error: InputsChanged: {e}", file=sys.stderr)
        return 1
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
