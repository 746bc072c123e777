"""``python -m pipeline check-params [--params FILE]`` and ``verify-shards DIR``."""

from __future__ import annotations

import argparse
import sys

from omegaconf import OmegaConf

from pipeline.cli import EXIT_BAD_INPUT, setup_logging
from pipeline.config import ParamsError, load_params, missing_keys, to_dict


def main(argv: list[str] | None = None) -> int:
    """Dispatch a sub-command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m pipeline")
    sub = parser.add_subparsers(dest="cmd", required=True)
    cp = sub.add_parser("check-params", help="validate a params file, print the resolved config")
    cp.add_argument("--params", default="params.yaml")
    vs = sub.add_parser("verify-shards", help="check shards against their manifest.json")
    vs.add_argument("dir", nargs="+", help="shard directories (each with a manifest.json)")
    args = parser.parse_args(argv)
    setup_logging()
    if args.cmd == "check-params":
        try:
            params = load_params(args.params)
        except ParamsError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        missing = missing_keys(args.params)
        if missing:
            print(f"error: {args.params}: missing keys {', '.join(missing)} (dvc repro needs "
                  "every key; copy them from params.yaml or a preset in configs/)",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        print(OmegaConf.to_yaml(OmegaConf.create(to_dict(params))), end="")
        return 0
    from pipeline.data.shards import verify_main

    return max(verify_main(d) for d in args.dir)


if __name__ == "__main__":
    sys.exit(main())
