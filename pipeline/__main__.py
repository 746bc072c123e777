"""``python -m pipeline check-params|verify-shards|clean-checkpoints|relocate-mlflow|compare``.

``clean-checkpoints [--keep N]`` deletes pretraining resume state of the repo (see
:mod:`pipeline.train.resume_store`). ``relocate-mlflow [--from OLD] [--to NEW]`` repoints the
MLflow database at a moved repo (see :mod:`pipeline.tracking.relocate`).

``check-params [--show]`` validates a whole params file (every key present, typed and in
range) and prints one ``ok`` line, the resolved config too with ``--show``; the ``check_params``
DVC stage (``stages/check_params.py``) runs the same check. ``verify-shards`` checks shard
directories or URLs against their manifests. ``compare [--width N]`` prints every experiment's
changed params and headline metrics in one table (see :mod:`pipeline.compare`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline import signals
from pipeline.cli import EXIT_BAD_INPUT, setup_logging
from pipeline.data.remote import ShardURL, shards_location
from pipeline.data.shards import MANIFEST_NAME, ShardError, read_manifest, verify_shards
from pipeline.data.sources import SPLITS


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
    cp = sub.add_parser("check-params", help="validate a params file (one line: ok or error)")
    cp.add_argument("--params", default="params.yaml")
    cp.add_argument("--show", action="store_true",
                    help="also print the resolved config (YAML, every key)")
    vs = sub.add_parser("verify-shards", help="check shards against their manifest.json")
    vs.add_argument("dir", nargs="+", help="shard directories (each with a manifest.json)")
    cc = sub.add_parser("clean-checkpoints",
                        help="delete pretraining resume state (.checkpoints/pretrain/<key>/)")
    cc.add_argument("--keep", type=int, default=0,
                    help="keep the N most recently written (default: %(default)s, delete all)")
    rm = sub.add_parser("relocate-mlflow",
                        help="repoint the MLflow database's artifact locations at a moved repo")
    rm.add_argument("--from", dest="old", default=None,
                    help="the old repo root (default: every root the database names that is "
                         "gone)")
    rm.add_argument("--to", dest="new", default=None,
                    help="the new repo root (default: this repo's root)")
    cm = sub.add_parser("compare", help="the experiments' changed params and headline metrics "
                                        "(from `dvc exp show --json`), one screen wide")
    cm.add_argument("--width", type=int, default=None,
                    help="the longest line (default: the terminal's width, else 160)")
    args = parser.parse_args(argv)
    setup_logging()
    if args.cmd == "relocate-mlflow":
        from pipeline.tracking.relocate import relocate_main

        return relocate_main(args.old, args.new)
    if args.cmd == "compare":
        from pipeline.compare import compare_main

        return compare_main(args.width)
    if args.cmd == "check-params":
        return _check_params(args.params, show=args.show)
    if args.cmd == "clean-checkpoints":
        from pipeline.train.resume_store import clean_main

        return clean_main(keep=args.keep)
    return max(verify_main(d) for d in args.dir)


def _check_params(path: str, *, show: bool = False) -> int:
    """``check-params``: one ``ok`` line (and the resolved YAML with ``show``) or one error."""
    from omegaconf import OmegaConf

    from pipeline.config import ParamsError, check_params_file, flatten, to_dict

    try:
        params = check_params_file(path)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    tree = to_dict(params)
    if show:
        print(OmegaConf.to_yaml(OmegaConf.create(tree)), end="")
    print(f"ok  {path}: {len(flatten(tree))} params, every key present, typed and in range"
          + ("" if show else " (--show prints them resolved)"))
    return 0


def verify_main(directory: str | Path) -> int:
    """CLI hook for ``python -m pipeline verify-shards DIR``.

    ``DIR`` is a split directory (holding ``manifest.json``) or the shards root holding split
    sub-directories; every split found is verified.

    Args:
        directory: the directory to verify.

    Returns:
        Exit code: 0 all good, 1 a problem (printed to stderr).
    """
    if isinstance(shards_location(directory), ShardURL):
        return _verify_url_main(shards_location(directory))
    directory = Path(directory)
    if (directory / MANIFEST_NAME).is_file():
        dirs = [directory]
    else:
        dirs = [d for d in sorted(directory.iterdir()) if (d / MANIFEST_NAME).is_file()] \
            if directory.is_dir() else []
    if not dirs:
        print(f"error: verify-shards: {directory}: no {MANIFEST_NAME} here or in its "
              "sub-directories", file=sys.stderr)
        return 1
    try:
        for d in dirs:
            r = verify_shards(d)
            print(f"ok  {r['dir']}: {r['split']} ({r['source']}), {r['num_samples']} samples "
                  f"in {r['num_shards']} shard(s), {r['bytes'] / 1e6:.1f} MB")
    except (ShardError, OSError) as e:
        print(f"error: verify-shards: {e}; rebuild with `dvc repro -f build_shards`",
              file=sys.stderr)
        return 1
    return 0


def _verify_url_main(base: ShardURL) -> int:
    """``verify-shards URL``: the URL of a split, else of a shards root with the three splits."""
    try:
        try:
            read_manifest(base)
            dirs = [base]
        except ShardError:
            dirs = [base / split for split in SPLITS]
        for d in dirs:
            r = verify_shards(d)
            print(f"ok  {r['dir']}: {r['split']} ({r['source']}), {r['num_samples']} samples "
                  f"in {r['num_shards']} shard(s), {r['bytes'] / 1e6:.1f} MB")
    except ShardError as e:
        print(f"error: verify-shards: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    signals.install()
    code, _ = signals.finish(main())
    sys.exit(code)
