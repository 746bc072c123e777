"""Helpers of the registry tests: a tiny trained encoder, publish and score it like the stages."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import build_tiny_shards, run_pretrain

from pipeline.config import Params, from_dict
from pipeline.data.manifest import read_manifest
from pipeline.tracking import stage_run
from pipeline.tracking.registry import (
    attach_scores,
    publish_encoder,
    trusted_encoder,
    update_champion,
)
from pipeline.train.training_input import TrainingInput, training_input

# 16 px with the stride-2 stem: a 1 x 1 last map; the tests compare with load_encoder's layer 4
PARAMS = {"embed": {"layer": 4, "pool_grid": 1}}


def train_tiny(root: Path) -> Path:
    """``root/data/shards`` + ``root/models/encoder.{pt,json,safetensors}`` (width 4)."""
    shards = build_tiny_shards(root / "data/shards", n_pretrain=32, n_train=16, n_test=16)
    run_pretrain(shards, root / "models", {"moco": {"K": 16}, "pretrain": {"epochs": 1}})
    return root


def training_of(p: Params) -> TrainingInput:
    """The training input of the tiny encoder in the current directory (one process)."""
    return training_input(p, read_manifest(Path("data/shards/pretrain")), 1)


def publish(p: Params | None = None) -> dict:
    """What the pretrain stage does after training, in the current directory: runs/pretrain.json."""
    p = p or from_dict(PARAMS)
    with stage_run("pretrain", p) as r:
        publish_encoder(r, params=p, training=training_of(p),
                        encoder_path=Path("models/encoder.pt"),
                        example_split=Path("data/shards/test"))
    return json.loads(Path("runs/pretrain.json").read_text())


def other_bytes() -> None:
    """One more trailing byte on ``models/encoder.pt``: the same weights (torch reads the zip
    from its end record), another md5, so the next :func:`publish` registers a new version."""
    enc = Path("models/encoder.pt")
    enc.write_bytes(enc.read_bytes() + b"\0")


def score(stage: str, top1: float, p: Params | None = None) -> int | None:
    """What the knn / linear stage does with its metrics; the champion version for linear."""
    p = p or from_dict(PARAMS)
    with stage_run(stage, p, upstream=("pretrain",)) as r:
        test = r.log_shards(Path("data/shards/test"), context="evaluation")
        encoder = trusted_encoder(r, params=p, encoder_path=Path("models/encoder.pt"),
                                  example_split=Path("data/shards/test"))
        attach_scores(r, stage, {"top1": top1, "top5": 100.0, "k": 20}, encoder=encoder,
                      dataset=test)
        return update_champion(r, encoder) if stage == "linear" else None
