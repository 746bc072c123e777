"""Pretrain throughput at ONE shape and ONE precision: plain loop, lightly, engine, stage; JSON.

Every row runs the default params' model and batch (backbone, width, head, K, m, T, SplitBN
groups, batch size, image size from the pretrain manifest) under the same autocast dtype
(``--precision``, default: what ``pretrain.precision: auto`` picks on this machine), on the
same threads, interleaved over ``--repeats`` rounds so background load hits all rows alike:

* ``plain``: a minimal MoCo loop written here (the CIFAR-10 demo's shape: SplitBN written
  here, EMA, shuffled keys, InfoNCE against a queue, SGD), on cached float views: the floor.
* ``lightly``: the same loop from lightly's MoCo blocks (``MoCoProjectionHead``,
  ``NTXentLoss(memory_bank_size=(K, D))``, ``update_momentum``, ``batch_shuffle``) on the same
  backbone and views (needs ``pip install .[bench]``; skipped when lightly is missing).
* ``moco_module``: the plain loop around the project's :class:`pipeline.moco.model.MoCo`
  (cached float views): what the MoCo module costs over the plain loop.
* ``engine_cached``: :func:`pipeline.train.engine.pretrain` with its loader replaced by one
  cached uint8 batch: adds the views made on the device, schedules, logging.
* ``stage``: the engine with the real loader (as the pretrain stage runs).
* ``views``: BatchTwoCrop alone on the cached uint8 batch (images/s of pairs).

A rate is the median over 10-step windows after the first window, then the median over
rounds. Ratios are to ``plain`` in the same run.

Usage: ``python benchmarks/pretrain_step.py [--steps 60] [--repeats 3] [--precision bf16]``
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import pipeline.train.engine as engine
from pipeline.config import load_params
from pipeline.data.shards import image_spec, read_manifest
from pipeline.data.views import BatchTwoCrop, build_batch_view
from pipeline.moco.backbones import build_backbone, build_head, resolve_small_stem
from pipeline.train.plan import build_moco
from pipeline.train.runtime import resolve_precision

WINDOW = 10  # steps per measured window (the stage's log_every_steps)
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class DemoSplitBN(nn.BatchNorm2d):
    """SplitBatchNorm as the MoCo CIFAR-10 demo writes it (train mode: groups of the batch)."""

    def __init__(self, num_features: int, num_splits: int) -> None:
        super().__init__(num_features)
        self.num_splits = num_splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        if not self.training:
            return super().forward(x)
        s = self.num_splits
        rm, rv = self.running_mean.repeat(s), self.running_var.repeat(s)
        y = F.batch_norm(x.view(-1, c * s, h, w), rm, rv, self.weight.repeat(s),
                         self.bias.repeat(s), True, self.momentum, self.eps).view(n, c, h, w)
        self.running_mean.data.copy_(rm.view(s, c).mean(0))
        self.running_var.data.copy_(rv.view(s, c).mean(0))
        return y


def _demo_bn(module: nn.Module, splits: int) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(module, name, DemoSplitBN(child.num_features, splits))
        else:
            _demo_bn(child, splits)
    return module


def _autocast(dtype: torch.dtype | None):
    return torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None)


def _window_rates(step, steps: int, batch: int) -> list[float]:
    """Images/s of each WINDOW-step window of ``step()`` calls, the first (warm-up) dropped."""
    rates = []
    for _ in range(steps // WINDOW):
        t0 = time.perf_counter()
        for _ in range(WINDOW):
            step()
        rates.append(WINDOW * batch / (time.perf_counter() - t0))
    return rates[1:]


def _backbone(p, channels: int, size: int) -> nn.Module:
    torch.manual_seed(p.seed)
    return build_backbone(p.model.backbone, width=p.model.width, in_channels=channels,
                          small_stem=resolve_small_stem(p.model.small_stem, size),
                          stem_stride=p.model.stem_stride)


def plain_rate(p, views, dtype, steps: int, channels: int, size: int) -> float:
    """The minimal MoCo loop (no project MoCo code), images/s."""
    bb = _backbone(p, channels, size)
    q_enc = _demo_bn(nn.Sequential(bb, build_head(p.model.head, bb.num_features,
                                                  p.model.head_hidden, p.model.dim)),
                     p.moco.bn_splits)
    k_enc = copy.deepcopy(q_enc).requires_grad_(False)
    queue = F.normalize(torch.randn(p.model.dim, p.moco.K), dim=0)
    state = {"ptr": 0}
    opt = torch.optim.SGD(q_enc.parameters(), lr=p.pretrain.lr * p.pretrain.batch_size / 256,
                          momentum=p.pretrain.sgd_momentum, weight_decay=p.pretrain.weight_decay)
    x_q, x_k = views
    n = x_q.shape[0]

    def step() -> None:
        with _autocast(dtype):
            q = F.normalize(q_enc(x_q), dim=1)
            with torch.no_grad():
                for pk, pq in zip(k_enc.parameters(), q_enc.parameters()):
                    pk.mul_(p.moco.m).add_(pq.detach(), alpha=1 - p.moco.m)
                perm = torch.randperm(n)
                k = F.normalize(k_enc(x_k[perm]), dim=1)[torch.argsort(perm)]
        q, k = q.float(), k.float()
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue], 1) / p.moco.T
        loss = F.cross_entropy(logits, torch.zeros(n, dtype=torch.long))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            idx = (state["ptr"] + torch.arange(n)) % p.moco.K
            queue[:, idx] = k.T
            state["ptr"] = (state["ptr"] + n) % p.moco.K

    return statistics.median(_window_rates(step, steps, n))


def lightly_rate(p, views, dtype, steps: int, channels: int, size: int) -> float | None:
    """The same loop from lightly's MoCo blocks on the same backbone, images/s."""
    try:
        from lightly.loss import NTXentLoss
        from lightly.models.modules import MoCoProjectionHead
        from lightly.models.utils import batch_shuffle, batch_unshuffle, update_momentum
    except ImportError:
        return None
    bb = _backbone(p, channels, size)
    q_enc = _demo_bn(nn.Sequential(bb, MoCoProjectionHead(bb.num_features, p.model.head_hidden,
                                                          p.model.dim)), p.moco.bn_splits)
    k_enc = copy.deepcopy(q_enc).requires_grad_(False)
    crit = NTXentLoss(temperature=p.moco.T, memory_bank_size=(p.moco.K, p.model.dim))
    opt = torch.optim.SGD(q_enc.parameters(), lr=p.pretrain.lr * p.pretrain.batch_size / 256,
                          momentum=p.pretrain.sgd_momentum, weight_decay=p.pretrain.weight_decay)
    x_q, x_k = views

    def step() -> None:
        with _autocast(dtype):
            q = q_enc(x_q)
            with torch.no_grad():
                update_momentum(q_enc, k_enc, m=p.moco.m)
                xs, shuffle = batch_shuffle(x_k)
                k = batch_unshuffle(k_enc(xs), shuffle)
        loss = crit(q.float(), k.float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return statistics.median(_window_rates(step, steps, x_q.shape[0]))


def module_rate(p, views, dtype, steps: int, channels: int, size: int) -> float:
    """The plain loop around the project's MoCo module (cached float views), images/s."""
    torch.manual_seed(p.seed)
    net = build_moco(p.model, p.moco, in_channels=channels, image_size=size).train()
    opt = torch.optim.SGD(net.trainable_parameters(), lr=p.pretrain.lr * p.pretrain.batch_size
                          / 256, momentum=p.pretrain.sgd_momentum,
                          weight_decay=p.pretrain.weight_decay)
    x_q, x_k = views
    state = {"s": 0}

    def step() -> None:
        with _autocast(dtype):
            out = net(x_q, x_k, m=p.moco.m, step=state["s"])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        state["s"] += 1

    return statistics.median(_window_rates(step, steps, x_q.shape[0]))


def engine_rate(p, shards: Path, precision: str, steps: int, cached: torch.Tensor | None
                ) -> dict:
    """pipeline.train.engine.pretrain on a cached uint8 batch (or the real loader)."""
    p.pretrain.steps_per_epoch, p.pretrain.epochs = steps, 1
    p.pretrain.knn_every_epochs, p.pretrain.checkpoint_every_steps = 0, 0
    p.pretrain.log_every_steps, p.pretrain.precision = WINDOW, precision
    p.pretrain.num_threads = torch.get_num_threads()
    original = engine.train_loader
    if cached is not None:
        batch = (cached, [""] * len(cached))
        engine.train_loader = lambda *a, steps, skip_batches=0, **k: (
            batch for _ in range(steps - skip_batches))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            engine.pretrain(model=p.model, moco=p.moco, opt=p.pretrain, augment=p.augment,
                            seed=p.seed, shards_dir=shards, encoder_path=out / "e.pt",
                            checkpoint_dir=out / "ck", metrics_path=out / "m.json",
                            plots_path=out / "p.tsv", knn_plots_path=out / "k.tsv")
            rows = [line.split("\t") for line in (out / "p.tsv").read_text().splitlines()]
    finally:
        engine.train_loader = original
    vals = [dict(zip(rows[0], r)) for r in rows[2:]]  # header and the warm-up window dropped
    return {"images_per_s": statistics.median(float(v["images_per_s"]) for v in vals),
            "data_wait_fraction": statistics.median(float(v["data_wait_fraction"])
                                                    for v in vals)}


def views_rate(p, cached: torch.Tensor, spec, repeats: int = 20) -> float:
    """BatchTwoCrop alone on the cached uint8 batch: image pairs/s."""
    two = BatchTwoCrop(build_batch_view(p.augment.preset, spec.size, spec.mean, spec.std,
                                        p.augment.crop_min_scale))
    two(cached, 0)
    t0 = time.perf_counter()
    for i in range(repeats):
        two(cached, i)
    return repeats * len(cached) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--shards", default=None, help="default: data.shards_dir of the params")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--precision", choices=["auto", *DTYPES], default="auto")
    args = ap.parse_args()
    p = load_params(args.params)
    shards = Path(args.shards or p.data.shards_dir)
    spec = image_spec(read_manifest(shards / "pretrain"), shards / "pretrain")
    dtype = resolve_precision(args.precision, torch.device("cpu"))
    precision = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    b, c, s = p.pretrain.batch_size, spec.channels, spec.size
    g = torch.Generator().manual_seed(0)
    cached = torch.randint(0, 256, (b, c, s, s), generator=g, dtype=torch.uint8)
    views = BatchTwoCrop(build_batch_view(p.augment.preset, s, spec.mean, spec.std,
                                          p.augment.crop_min_scale))(cached, 0)
    rows: dict[str, list[float]] = {k: [] for k in ("plain", "lightly", "moco_module",
                                                    "engine_cached", "stage")}
    wait = []
    for _ in range(args.repeats):
        rows["plain"].append(plain_rate(p, views, dtype, args.steps, c, s))
        lr = lightly_rate(p, views, dtype, args.steps, c, s)
        if lr is not None:
            rows["lightly"].append(lr)
        rows["moco_module"].append(module_rate(p, views, dtype, args.steps, c, s))
        rows["engine_cached"].append(engine_rate(load_params(args.params), shards, precision,
                                                 args.steps, cached)["images_per_s"])
        st = engine_rate(load_params(args.params), shards, precision, args.steps, None)
        rows["stage"].append(st["images_per_s"])
        wait.append(st["data_wait_fraction"])
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    print(json.dumps({
        "config": {"backbone": p.model.backbone, "width": p.model.width, "K": p.moco.K,
                   "batch_size": b, "image_size": s, "channels": c, "precision": precision,
                   "threads": torch.get_num_threads(), "steps": args.steps,
                   "repeats": args.repeats},
        "images_per_s": {k: round(v, 1) for k, v in med.items()},
        "over_plain": {k: round(v / med["plain"], 3) for k, v in med.items()},
        "stage_data_wait_fraction": round(statistics.median(wait), 3),
        "views_pairs_per_s": round(views_rate(p, cached, spec), 1),
    }, indent=2))


if __name__ == "__main__":
    main()
