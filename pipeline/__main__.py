"""``python -m pipeline check-params``, ``verify-shards DIR`` and ``clean-checkpoints``.

``check-params [--params FILE] [--stamp PATH]``, ``verify-shards DIR...``,
``clean-checkpoints [--keep N]`` (delete pretraining resume state of the repo: see
:mod:`pipeline.train.resume_store`).

``check-params --stamp runs/check_params.json`` is the first DVC stage: it validates the whole
params file (every key present, typed and in range) before any other stage deletes its outputs,
and writes a content-stable stamp (the same bytes for every valid file) that every stage depends
on.
"""

from __future__ import annotations

import argparse
import sys

from pipeline import signals
from pipeline.cli import EXIT_BAD_INPUT, setup_logging

STAMP = {"stage": "check_params", "run_id": None, "params": "valid"}


def main(argv: list[str] | None = None) -> int:
    """Dispatch a sub-command; returns the exit code (128 + signum on SIGTERM/SIGINT)."""
    try:
        return _main(argv)
    except signals.Terminated as e:
        print(f"error: Terminated: {e}", file=sys.stderr)
        return e.exit_code


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline")
    sub = parser.add_subparsers(dest="cmd", required=True)
    cp = sub.add_parser("check-params", help="validate a params file, print the resolved config")
    cp.add_argument("--params", default="params.yaml")
    cp.add_argument("--stamp", default=None,
                    help="write this content-stable file instead of printing the config "
                         "(the check_params DVC stage)")
    vs = sub.add_parser("verify-shards", help="check shards against their manifest.json")
    vs.add_argument("dir", nargs="+", help="shard directories (each with a manifest.json)")
    cc = sub.add_parser("clean-checkpoints",
                        help="delete pretraining resume state (.checkpoints/pretrain/<key>/)")
    cc.add_argument("--keep", type=int, default=0,
                    help="keep the N most recently written (default: %(default)s, delete all)")
    args = parser.parse_args(argv)
    setup_logging()
    if args.cmd == "check-params":
        return _check_params(args.params, args.stamp)
    if args.cmd == "clean-checkpoints":
        from pipeline.train.resume_store import clean_main

        return clean_main(keep=args.keep)
    from pipeline.data.shards import verify_main

    return max(verify_main(d) for d in args.dir)


def _check_params(path: str, stamp: str | None) -> int:
    from omegaconf import OmegaConf

    from pipeline.config import ParamsError, load_params, missing_keys, to_dict

    try:
        params = load_params(path)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    missing = missing_keys(path)
    if missing:
        print(f"error: {path}: missing keys {', '.join(missing)} (dvc repro needs "
              "every key; copy them from params.yaml or a preset in configs/)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if stamp:
        from pipeline.atomic import write_json

        write_json(stamp, STAMP)
    else:
        print(OmegaConf.to_yaml(OmegaConf.create(to_dict(params))), end="")
    return 0


if __name__ == "__main__":
    signals.install()
    code, _ = signals.finish(main())
    sys.exit(code)
