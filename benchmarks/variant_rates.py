"""Pretraining img/s of recipe variants with the real loader, in one run (equal wall time).

Each variant is the default params plus ``-S``-style overrides (``section.key=value``); every
variant runs ``--steps`` steps of the real pretrain engine on the default shards, interleaved over
``--repeats`` rounds, and the median window rate is printed with its ratio to the first variant.
A sweep at equal wall time gives variant ``v`` ``epochs * rate_v / rate_0`` of the first
variant's epochs (``pretrain.steps_per_epoch`` for a fraction of an epoch).

Usage::

    python benchmarks/variant_rates.py --variant base \\
        --variant mc2 augment.small_crops=2 augment.small_crop_size=14 \\
        --variant w48 model.width=48
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml
from pretrain_step import engine_rate

from pipeline.config import from_dict


def params_with(path: str, overrides: list[str]):
    tree = yaml.safe_load(Path(path).read_text())
    for item in overrides:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        tree.setdefault(section, {})[name] = yaml.safe_load(value)
    return from_dict(tree)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--shards", default=None)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variant", nargs="+", action="append", required=True,
                    metavar=("NAME", "KEY=VALUE"))
    args = ap.parse_args()
    variants = {v[0]: v[1:] for v in args.variant}
    shards = Path(args.shards or params_with(args.params, []).data.shards_dir)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, over in variants.items():
            p = params_with(args.params, over)
            rates[name].append(engine_rate(p, shards, str(p.pretrain.precision), args.steps,
                                           None)["images_per_s"])
    med = {k: statistics.median(v) for k, v in rates.items()}
    first = next(iter(med.values()))
    print(json.dumps({"steps": args.steps, "repeats": args.repeats,
                      "variants": {k: " ".join(v) for k, v in variants.items()},
                      "images_per_s": {k: round(v, 1) for k, v in med.items()},
                      "over_first": {k: round(v / first, 3) for k, v in med.items()}},
                     indent=2))


if __name__ == "__main__":
    main()
