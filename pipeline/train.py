"""The MoCo pretraining engine: schedules, precision, DDP, checkpoint/resume, kNN monitor, export.

One code path serves one CPU process, one GPU and N processes under ``torchrun`` (gloo on CPU,
NCCL on GPU). The device is chosen once in :func:`setup_device` and passed along; no module
hard-codes a device.

Epochs are defined in optimizer steps: ``steps_per_epoch`` full global batches (default
``pretrain images // batch_size``), identical on every rank, so DDP can never hang. The lr and
momentum schedules are precomputed per optimizer step.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.atomic import write_tsv
from pipeline.checkpoint import fingerprint, load_checkpoint, save_atomic
from pipeline.config import AugmentParams, MocoParams, ModelParams, PretrainParams
from pipeline.data import augment as aug
from pipeline.data.loader import eval_loader, read_manifest, train_loader
from pipeline.evaluate.features import extract_features
from pipeline.evaluate.knn import knn_classify
from pipeline.moco.backbones import build_backbone, build_head, resolve_small_stem
from pipeline.moco.batchnorm import check_bn_mode
from pipeline.moco.model import MoCo
from pipeline.moco.momentum import momentum_schedule
from pipeline.tracking import StageRun, Terminated, write_json_atomic

log = logging.getLogger(__name__)

PLOT_COLUMNS = ("step", "epoch", "loss", "lr", "m", "inst_top1", "inst_top5", "queue_mean_age",
                "data_wait_fraction", "images_per_s")


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; training stopped before the optimizer step."""


@dataclass
class Runtime:
    """Where and how this process runs."""

    device: torch.device
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, checkpoints and exports."""
        return self.rank == 0


def setup_device() -> Runtime:
    """Initialise torch.distributed from torchrun's environment (if present) and pick a device.

    Returns:
        The :class:`Runtime`: ``cuda:LOCAL_RANK`` when CUDA exists, else CPU; gloo on CPU,
        NCCL on CUDA.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Runtime(device=device, rank=rank, world_size=world, local_rank=local)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``precision`` on ``device`` (None = fp32, no autocast).

    ``auto`` = bf16 on CUDA with bf16 support, fp16 (+ GradScaler) on older CUDA, fp32 on CPU
    (bf16 autocast on a CPU without native bf16 was measured ~30x slower than fp32).
    """
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return None


def lr_schedule(*, base_lr: float, batch_size: int, total_steps: int, steps_per_epoch: int,
                schedule: str, warmup_epochs: float = 0.0,
                milestones: list[int] | tuple[int, ...] = ()) -> list[float]:
    """The learning rate of every optimizer step.

    Args:
        base_lr: lr per 256 images; the effective lr is ``base_lr * batch_size / 256``
            (linear scaling, Goyal et al. 2017, as in MoCo).
        batch_size: global batch size (images per optimizer step).
        total_steps: optimizer steps of the whole run.
        steps_per_epoch: optimizer steps per epoch.
        schedule: ``cosine`` (half-cosine to 0, MoCo v2) or ``step`` (x0.1 at each milestone
            epoch, MoCo v1).
        warmup_epochs: linear warmup from 0 over this many epochs.
        milestones: epochs at which the step schedule multiplies the lr by 0.1.

    Returns:
        ``total_steps`` learning rates.
    """
    peak = base_lr * batch_size / 256
    warm = int(round(warmup_epochs * steps_per_epoch))
    out = []
    for s in range(total_steps):
        if s < warm:
            lr = peak * (s + 1) / warm
        elif schedule == "cosine":
            lr = peak * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total_steps - warm)))
        else:
            epoch = s / steps_per_epoch
            lr = peak * 0.1 ** sum(epoch >= m for m in milestones)
        out.append(lr)
    assert len(out) == total_steps
    return out


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA max allocated, else max RSS (Linux reports KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def image_spec(manifest: dict[str, Any], where: Path) -> tuple[int, int, tuple, tuple]:
    """(channels, image size in px, mean, std) of a split from its manifest.

    Raises:
        ValueError: the split holds images of mixed sizes (set ``data.image_size``).
    """
    shape = manifest.get("image_shape")
    if not shape or shape[1] != shape[2]:
        raise ValueError(f"{where}/manifest.json: images are not all the same square size "
                         f"({shape}); set data.image_size to resize them when sharding")
    return int(shape[0]), int(shape[1]), tuple(manifest["mean"]), tuple(manifest["std"])


def build_moco(model: ModelParams, moco: MocoParams, *, in_channels: int, image_size: int,
               world_size: int = 1) -> MoCo:
    """Build the MoCo module (query + key encoders, queue) for the given params.

    Raises:
        ValueError: an invalid backbone name or BN mode for ``world_size``.
    """
    backbone = build_backbone(model.backbone, width=model.width, in_channels=in_channels,
                              small_stem=resolve_small_stem(model.small_stem, image_size))
    head = build_head(model.head, backbone.num_features, model.head_hidden, model.dim)
    return MoCo(backbone, head, K=moco.K, m=moco.m, T=moco.T, symmetric=moco.symmetric,
                bn=moco.bn, bn_splits=moco.bn_splits, world_size=world_size)


def encoder_meta(model: ModelParams, *, in_channels: int, image_size: int,
                 num_features: int) -> dict[str, Any]:
    """The architecture needed to load ``encoder.pt`` back (written as ``encoder.json``)."""
    return {"backbone": model.backbone, "width": model.width, "in_channels": in_channels,
            "small_stem": resolve_small_stem(model.small_stem, image_size),
            "image_size": image_size, "num_features": num_features}


class _StopFlag:
    """SIGTERM or SIGINT sets a flag; the loop checkpoints at the next step boundary, then stops."""

    def __init__(self) -> None:
        self.raised = False
        self.signum = signal.SIGTERM

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.raised:
            self.signum = signum
        self.raised = True


def _knn_monitor(backbone: nn.Module, shards_dir: Path, *, transform: Any, device: torch.device,
                 n_train: int, n_test: int, batch_size: int) -> dict[str, float]:
    """Weighted kNN (k=200, T=0.1, MoCo CIFAR demo) of the query backbone, BN in eval mode."""
    train = extract_features(backbone, eval_loader(shards_dir / "train", transform=transform,
                                                   batch_size=batch_size, max_images=n_train),
                             device=device, progress=False)
    test = extract_features(backbone, eval_loader(shards_dir / "test", transform=transform,
                                                  batch_size=batch_size, max_images=n_test),
                            device=device, progress=False)
    res = knn_classify(train.features, train.labels, test.features, test.labels, k=200, T=0.1)
    return {"knn_top1": float(res.top1), "knn_top5": float(res.top5)}


def pretrain(*, model: ModelParams, moco: MocoParams, opt: PretrainParams, augment: AugmentParams,
             seed: int, shards_dir: Path, encoder_path: Path, checkpoint_dir: Path,
             metrics_path: Path, plots_path: Path, knn_plots_path: Path,
             run: StageRun | None = None, max_steps: int | None = None) -> dict[str, float]:
    """Pretrain MoCo on the ``pretrain`` shards and export the query backbone.

    Args:
        model: backbone and head params.
        moco: queue/loss params (K, m, T, BN mode).
        opt: optimisation params (``pretrain`` section).
        augment: augmentation preset.
        seed: global seed (model init, data order, augmentation).
        shards_dir: directory holding ``pretrain/``, ``train/``, ``test/`` shard folders.
        encoder_path: where the QUERY backbone ``state_dict`` is written (plain BatchNorm2d,
            no ``fc.*``); ``encoder.json`` beside it records the architecture and ``head.pt``
            the query projection head.
        checkpoint_dir: ``last.pt`` lives here (a ``persist: true`` DVC output).
        metrics_path: final metrics JSON (``metrics/pretrain.json``).
        plots_path: per-logged-step TSV (``plots/pretrain.tsv``).
        knn_plots_path: kNN-monitor TSV per epoch (``plots/knn_monitor.tsv``).
        run: MLflow handle (rank 0) or None.
        max_steps: stop after this global step (tests simulate an interruption with it).

    Returns:
        The final metrics (also written to ``metrics_path``).

    Raises:
        NonFiniteLossError: the loss became NaN/inf (the last good checkpoint is kept).
        Terminated: SIGTERM was received (a checkpoint was written first).
    """
    rt = setup_device()
    t_start = time.time()
    manifest = read_manifest(shards_dir / "pretrain")
    n_images = int(manifest["num_samples"])
    channels, image_size, mean, std = image_spec(manifest, shards_dir / "pretrain")
    if opt.batch_size % rt.world_size:
        raise ValueError(f"pretrain.batch_size ({opt.batch_size}) must be divisible by the "
                         f"number of processes ({rt.world_size})")
    per_rank = opt.batch_size // rt.world_size
    spe = opt.steps_per_epoch or n_images // opt.batch_size
    if spe < 1:
        raise ValueError(f"pretrain.batch_size ({opt.batch_size}) exceeds the {n_images} "
                         "pretraining images: lower it or add images")
    total = spe * opt.epochs
    check_bn_mode(moco.bn, per_rank, moco.bn_splits, rt.world_size)
    if moco.bn == "sync" and rt.device.type != "cuda":
        raise ValueError("moco.bn = 'sync' needs CUDA (torch's SyncBatchNorm rejects CPU tensors "
                         "in training); use 'shuffle' under torchrun on CPU")
    if moco.K > n_images // 2:
        log.warning("moco.K = %d exceeds half the pretraining set (%d images): the queue holds "
                    "several keys of the same image", moco.K, n_images)

    if opt.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=rt.device.type == "cuda")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    elif rt.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(seed)
    net = build_moco(model, moco, in_channels=channels, image_size=image_size,
                     world_size=rt.world_size).to(rt.device)
    if rt.device.type == "cuda" and opt.channels_last:
        net = net.to(memory_format=torch.channels_last)
    amp_dtype = resolve_precision(opt.precision, rt.device)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=amp_dtype == torch.float16)
    optimizer = torch.optim.SGD(net.trainable_parameters(), lr=0.0, momentum=opt.sgd_momentum,
                                weight_decay=opt.weight_decay)
    lrs = lr_schedule(base_lr=opt.lr, batch_size=opt.batch_size, total_steps=total,
                      steps_per_epoch=spe, schedule=opt.lr_schedule,
                      warmup_epochs=opt.warmup_epochs, milestones=opt.lr_milestones)
    ms = momentum_schedule(moco.m, total, moco.m_schedule)
    assert len(lrs) == len(ms) == total

    train_params = {"seed": seed, "model": asdict(model), "moco": asdict(moco),
                    "augment": asdict(augment), "world_size": rt.world_size,
                    "pretrain": {k: v for k, v in asdict(opt).items() if k not in (
                        "checkpoint_every_epochs", "checkpoint_every_steps", "knn_every_epochs",
                        "knn_monitor_train_images", "knn_monitor_test_images",
                        "log_every_steps", "compile")}}
    fp = fingerprint(train_params, [s["sha256"] for s in manifest["shards"]])
    ckpt_path = checkpoint_dir / "last.pt"
    state = load_checkpoint(ckpt_path, fp)  # every rank resumes from rank 0's file
    step, rows, knn_rows, wall_before = 0, [], [], 0.0
    if state is not None:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng_cpu"])
        step, rows, knn_rows = int(state["step"]), list(state["rows"]), list(state["knn_rows"])
        wall_before = float(state["wall_time_s"])

    ddp_net: nn.Module = net
    if rt.world_size > 1:
        # No buffer sync: queues are identical by construction (gathered keys), and syncing
        # would re-broadcast the whole (D, K) queue every step.
        ddp_net = nn.parallel.DistributedDataParallel(
            net, device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
            **_no_buffer_sync_kwargs())
    if opt.compile and rt.device.type == "cuda":
        ddp_net = torch.compile(ddp_net)

    two_crop = aug.TwoCropTransform(aug.build_pretrain_transform(
        augment.preset, image_size, mean, std, crop_min_scale=augment.crop_min_scale))
    eval_tf = aug.build_eval_transform(image_size, mean, std)

    def save(step_now: int) -> None:
        if not rt.is_main:
            return
        save_atomic({"fingerprint": fp, "step": step_now, "model": net.state_dict(),
                     "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                     "rng_cpu": torch.get_rng_state(), "rows": rows, "knn_rows": knn_rows,
                     "wall_time_s": wall_before + time.time() - t_start}, ckpt_path)

    def monitor(epoch: int) -> None:
        if not (rt.is_main and opt.knn_every_epochs):
            return
        t0 = time.time()
        res = _knn_monitor(net.encoder_q.backbone, shards_dir, transform=eval_tf,
                           device=rt.device, n_train=opt.knn_monitor_train_images,
                           n_test=opt.knn_monitor_test_images, batch_size=512)
        knn_rows.append({"epoch": epoch, "step": epoch * spe, **res})
        log.info("kNN monitor epoch %d: top-1 %.2f%% top-5 %.2f%% (%.1fs)", epoch,
                 res["knn_top1"], res["knn_top5"], time.time() - t0)
        if run is not None:
            run.log_metrics({f"monitor_{k}": v for k, v in res.items()}, step=epoch * spe)

    if step == 0 and not knn_rows:
        monitor(0)  # the random-init encoder: the curve's starting point
    stop = _StopFlag()
    prev_handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    use_bar = rt.is_main and sys.stderr.isatty()
    bar = None
    if use_bar:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, desc="pretrain", unit="step")
    last_stats: dict[str, float] = {}
    try:
        while step < total and (max_steps is None or step < max_steps):
            epoch = step // spe
            loader = train_loader(shards_dir / "pretrain", transform=two_crop,
                                  batch_size=per_rank, steps=spe, epoch=epoch, seed=seed,
                                  rank=rt.rank, world_size=rt.world_size,
                                  num_workers=opt.num_workers, skip_batches=step - epoch * spe)
            net.train()
            win = {"loss": 0.0, "top1": 0.0, "top5": 0.0, "n": 0, "wait": 0.0, "t0": time.time()}
            it = iter(loader)
            while step < (epoch + 1) * spe and (max_steps is None or step < max_steps):
                t_wait = time.time()
                im_q, im_k = next(it)
                win["wait"] += time.time() - t_wait
                im_q = im_q.to(rt.device, non_blocking=True)
                im_k = im_k.to(rt.device, non_blocking=True)
                if rt.device.type == "cuda" and opt.channels_last:
                    im_q = im_q.contiguous(memory_format=torch.channels_last)
                    im_k = im_k.contiguous(memory_format=torch.channels_last)
                for g in optimizer.param_groups:
                    g["lr"] = lrs[step]
                with torch.autocast(rt.device.type, dtype=amp_dtype or torch.float32,
                                    enabled=amp_dtype is not None):
                    out = ddp_net(im_q, im_k, m=ms[step], step=step)
                loss = out.loss
                if not torch.isfinite(loss.detach()):
                    kept = (f"the last good checkpoint is kept at {ckpt_path}"
                            if ckpt_path.is_file() else "no checkpoint was written yet")
                    raise NonFiniteLossError(
                        f"non-finite loss ({loss.item()}) at step {step} (epoch {epoch}); "
                        f"training stopped, {kept}. Lower pretrain.lr or check the data")
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                step += 1
                win["loss"] += loss.item()
                win["top1"] += float(out.top1)
                win["top5"] += float(out.top5)
                win["n"] += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss.item():.3f}")
                if step % opt.log_every_steps == 0 or step == total:
                    dt = time.time() - win["t0"]
                    n = win["n"]
                    last_stats = {
                        "step": step, "epoch": step / spe, "loss": win["loss"] / n,
                        "lr": lrs[step - 1], "m": ms[step - 1], "inst_top1": win["top1"] / n,
                        "inst_top5": win["top5"] / n,
                        "queue_mean_age": float(net.queue.mean_age(step)),
                        "data_wait_fraction": win["wait"] / max(dt, 1e-9),
                        "images_per_s": n * opt.batch_size / max(dt, 1e-9)}
                    rows.append(last_stats)
                    if run is not None:
                        run.log_metrics({k: v for k, v in last_stats.items() if k != "step"},
                                        step=step)
                    if not use_bar and rt.is_main:
                        log.info("step %d/%d epoch %.2f loss %.4f inst-top1 %.1f%% lr %.4f "
                                 "%.0f img/s wait %.0f%%", step, total, step / spe,
                                 last_stats["loss"], last_stats["inst_top1"], last_stats["lr"],
                                 last_stats["images_per_s"], 100 * last_stats["data_wait_fraction"])
                    win = {"loss": 0.0, "top1": 0.0, "top5": 0.0, "n": 0, "wait": 0.0,
                           "t0": time.time()}
                epoch_end = step % spe == 0
                if epoch_end and opt.knn_every_epochs and (step // spe) % opt.knn_every_epochs == 0:
                    monitor(step // spe)
                if stop.raised:
                    save(step)
                    raise Terminated(f"{signal.Signals(stop.signum).name}: checkpoint written "
                                     f"at step {step}", signum=stop.signum)
                if ((epoch_end and (step // spe) % opt.checkpoint_every_epochs == 0)
                        or (opt.checkpoint_every_steps and step % opt.checkpoint_every_steps == 0)
                        or step == total):
                    save(step)
            del it, loader
    finally:
        for sig, h in prev_handlers.items():
            signal.signal(sig, h)
        if bar is not None:
            bar.close()

    if step < total:  # stopped early by max_steps (tests)
        return {"step": float(step)}
    wall = wall_before + time.time() - t_start
    final = rows[-1] if rows else {}
    metrics = {
        "loss": final.get("loss", float("nan")), "inst_top1": final.get("inst_top1", 0.0),
        "inst_top5": final.get("inst_top5", 0.0), "steps": total, "epochs": opt.epochs,
        "images_per_s": (sum(r["images_per_s"] for r in rows) / len(rows)) if rows else 0.0,
        "data_wait_fraction": (sum(r["data_wait_fraction"] for r in rows) / len(rows))
        if rows else 0.0,
        "wall_time_s": wall, "peak_memory_bytes": peak_memory_bytes(rt.device),
        "world_size": rt.world_size}
    if rt.world_size > 1:
        metrics["queue_ranks_identical"] = int(_queues_identical(net))
    if knn_rows:
        metrics["knn_top1"] = knn_rows[-1]["knn_top1"]
        metrics["knn_top5"] = knn_rows[-1]["knn_top5"]
        metrics["knn_top1_init"] = knn_rows[0]["knn_top1"]
    if rt.is_main:
        sd = net.export_backbone()
        save_atomic(sd, encoder_path)
        head = net.encoder_q.head
        save_atomic({"kind": model.head, "in_dim": net.encoder_q.backbone.num_features,
                     "hidden": model.head_hidden, "dim": model.dim,
                     "state_dict": {k: v.detach().cpu() for k, v in head.state_dict().items()}},
                    encoder_path.with_name("head.pt"))
        write_json_atomic(encoder_path.with_suffix(".json"), encoder_meta(
            model, in_channels=channels, image_size=image_size,
            num_features=net.encoder_q.backbone.num_features))
        write_json_atomic(metrics_path, metrics)
        write_tsv(plots_path, PLOT_COLUMNS, rows)
        write_tsv(knn_plots_path, ("epoch", "step", "knn_top1", "knn_top5"), knn_rows)
        if run is not None:
            run.log_metrics({f"final_{k}": v for k, v in metrics.items()})
    if rt.world_size > 1:
        dist.barrier()
    return metrics


def _queues_identical(net: MoCo) -> bool:
    """Whether every rank holds a bit-identical queue (keys, pointer); raises if not.

    Raises:
        RuntimeError: the queues diverged (keys must be gathered from all ranks before enqueue).
    """
    import hashlib

    h = hashlib.sha256(net.queue.keys.detach().cpu().numpy().tobytes())
    h.update(str(int(net.queue.ptr)).encode())
    mine = torch.tensor([int.from_bytes(h.digest()[:7], "big")], dtype=torch.int64,
                        device=net.queue.keys.device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    if any(int(t) != int(mine) for t in everyone):
        raise RuntimeError("the key queues differ across ranks after training")
    return True


def _no_buffer_sync_kwargs() -> dict[str, bool]:
    """DDP kwargs that disable buffer broadcasting (renamed in recent torch releases)."""
    import inspect

    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
