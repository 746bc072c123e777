"""The pretraining driver and the MoCo step.

Epochs are true epochs (:func:`pipeline.data.loader.train_loader`): ``steps_per_epoch`` full
global batches (default ``pretrain images // batch_size``), identical on every rank, so DDP can
never hang. The lr and momentum schedules are precomputed per optimizer step.
"""

from __future__ import annotations

import copy
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.checkpoint import fingerprint
from pipeline.config import AugmentParams, MocoParams, ModelParams, PretrainParams
from pipeline.data import augment as aug
from pipeline.data.batch_augment import BatchTwoCrop, batch_seed, build_batch_view
from pipeline.data.crop import RandomResizedCrop
from pipeline.data.loader import read_manifest, train_loader
from pipeline.data.workers import LoaderWorkerError, worker_death
from pipeline.moco.backbones import (
    build_backbone,
    build_head,
    resolve_small_stem,
    resolve_stem_stride,
)
from pipeline.moco.batchnorm import check_bn_mode
from pipeline.moco.model import MoCo, MocoOutput
from pipeline.moco.momentum import momentum_schedule
from pipeline.tracking import StageRun, Terminated
from pipeline.train.export import export_outputs, final_metrics
from pipeline.train.logging import LogWindow, format_row
from pipeline.train.monitor import KnnMonitor
from pipeline.train.runtime import (
    Precision,
    Runtime,
    choose_threads,
    configure_determinism,
    resolve_compile,
    resolve_precision,
    resolve_switch,
    setup_device,
    thread_candidates,
    usable_cores,
    wrap_model,
)
from pipeline.train.schedules import lr_schedule
from pipeline.train.signals import stop_on_signals
from pipeline.train.state import Checkpointer, CheckpointPolicy

log = logging.getLogger(__name__)

# pretrain.* keys that change how fast or how visibly training runs, never its result
NOT_FINGERPRINTED = ("checkpoint_every_epochs", "checkpoint_every_steps", "knn_every_epochs",
                     "knn_monitor_train_images", "knn_monitor_test_images", "log_every_steps",
                     "compile", "num_threads")


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; training stopped before the optimizer step."""


class PlanError(ValueError):
    """The run's sizes do not fit the data or the processes (the message names the param)."""


def train_step(net: nn.Module, images: torch.Tensor, *, views: BatchTwoCrop, aug_seed: int,
               optimizer: torch.optim.Optimizer, precision: Precision, lr: float, m: float,
               step: int) -> MocoOutput:
    """One MoCo step, as Algorithm 1 of He et al. (2020).

    Args:
        net: the MoCo module (possibly DDP-wrapped).
        images: ``(B, C, H, W)`` uint8 batch on the training device.
        views: makes the query and key views.
        aug_seed: the batch's augmentation seed (:func:`batch_seed`).
        optimizer: SGD over the query encoder.
        precision: autocast and gradient scaling.
        lr: this step's learning rate.
        m: this step's key-encoder momentum.
        step: global step (queue bookkeeping).

    Returns:
        The forward's :class:`MocoOutput` (loss, logits ``(B, 1 + K)``, instance accuracy).

    Raises:
        NonFiniteLossError: the loss is NaN or inf (nothing was updated by the optimizer).
    """
    im_q, im_k = views(images, aug_seed)  # two random views, (B, C, S, S) each
    for group in optimizer.param_groups:
        group["lr"] = lr
    with precision.autocast():
        out = net(im_q, im_k, m=m, step=step)  # q; EMA update; shuffled k; InfoNCE; enqueue
    if not torch.isfinite(out.loss.detach()):
        raise NonFiniteLossError(f"non-finite loss ({out.loss.item()}) at step {step}")
    precision.backward_and_step(out.loss, optimizer)  # SGD on the query encoder only
    return out


@dataclass
class RunPlan:
    """Sizes and schedules of a run, fixed before any training."""

    channels: int
    image_size: int
    mean: tuple
    std: tuple
    per_rank_batch: int
    steps_per_epoch: int
    total_steps: int
    lrs: list[float]
    momenta: list[float]
    crop_in_loader: bool = False  # variable-size (max_side) shards: RRC per image in workers


def image_spec(manifest: dict[str, Any], where: Path) -> tuple[int, int, tuple, tuple]:
    """(channels, image size in px, mean, std) of a split from its manifest.

    Shards built with ``data.max_side`` hold whole images of varying sizes; their training
    size is the build's ``image_size`` (the crop then runs per image in the loader workers).

    Raises:
        ValueError: the split holds images of mixed sizes (set ``data.image_size``).
    """
    shape = manifest.get("image_shape")
    build = manifest.get("build") or {}
    if not shape and build.get("max_side"):
        mean, std = tuple(manifest["mean"]), tuple(manifest["std"])
        return len(mean), int(build["image_size"]), mean, std
    if not shape or shape[1] != shape[2]:
        raise ValueError(f"{where}/manifest.json: images are not all the same square size "
                         f"({shape}); set data.image_size to resize them when sharding")
    return int(shape[0]), int(shape[1]), tuple(manifest["mean"]), tuple(manifest["std"])


def plan_run(manifest: dict[str, Any], where: Path, *, opt: PretrainParams, moco: MocoParams,
             rt: Runtime) -> RunPlan:
    """Check the run's sizes against the data and precompute the schedules.

    Raises:
        PlanError: batch not divisible by the ranks, an epoch longer than the data, a BN mode
            that does not fit, or SyncBN on CPU (each message names the param).
    """
    try:
        return _plan_run(manifest, where, opt=opt, moco=moco, rt=rt)
    except PlanError:
        raise
    except ValueError as e:  # check_bn_mode, image_spec: bad input, not a bug
        raise PlanError(str(e)) from None


def _plan_run(manifest: dict[str, Any], where: Path, *, opt: PretrainParams, moco: MocoParams,
              rt: Runtime) -> RunPlan:
    n_images = int(manifest["num_samples"])
    channels, image_size, mean, std = image_spec(manifest, where)
    if opt.batch_size % rt.world_size:
        raise PlanError(f"pretrain.batch_size ({opt.batch_size}) must be divisible by the "
                         f"number of processes ({rt.world_size})")
    full = n_images // opt.batch_size
    spe = opt.steps_per_epoch or full
    if full < 1:
        raise PlanError(f"pretrain.batch_size ({opt.batch_size}) exceeds the {n_images} "
                         "pretraining images: lower it or add images")
    if spe > full:
        raise PlanError(f"pretrain.steps_per_epoch ({spe}) exceeds one epoch of the {n_images} "
                         f"pretraining images at batch {opt.batch_size} ({full} steps)")
    check_bn_mode(moco.bn, opt.batch_size // rt.world_size, moco.bn_splits, rt.world_size)
    if moco.bn == "sync" and rt.device.type != "cuda":
        raise PlanError("moco.bn = 'sync' needs CUDA (torch's SyncBatchNorm rejects CPU tensors "
                         "in training); use 'shuffle' under torchrun on CPU")
    if moco.K > n_images // 2:
        log.warning("moco.K = %d exceeds half the pretraining set (%d images): the queue holds "
                    "several keys of the same image", moco.K, n_images)
    total = spe * opt.epochs
    lrs = lr_schedule(base_lr=opt.lr, batch_size=opt.batch_size, total_steps=total,
                      steps_per_epoch=spe, schedule=opt.lr_schedule,
                      warmup_epochs=opt.warmup_epochs, milestones=opt.lr_milestones)
    momenta = momentum_schedule(moco.m, total, moco.m_schedule)
    assert len(lrs) == len(momenta) == total
    return RunPlan(channels, image_size, mean, std, opt.batch_size // rt.world_size, spe, total,
                   lrs, momenta, crop_in_loader=not manifest.get("image_shape"))


def build_moco(model: ModelParams, moco: MocoParams, *, in_channels: int, image_size: int,
               world_size: int = 1) -> MoCo:
    """Build the MoCo module (query + key encoders, queue) for the given params.

    Raises:
        ValueError: an invalid backbone name or BN mode for ``world_size``.
    """
    small = resolve_small_stem(model.small_stem, image_size)
    backbone = build_backbone(model.backbone, width=model.width, in_channels=in_channels,
                              small_stem=small,
                              stem_stride=resolve_stem_stride(model.stem_stride, small))
    head = build_head(model.head, backbone.num_features, model.head_hidden, model.dim)
    return MoCo(backbone, head, K=moco.K, m=moco.m, T=moco.T, symmetric=moco.symmetric,
                bn=moco.bn, bn_splits=moco.bn_splits, world_size=world_size)


def _training_params(seed: int, model: ModelParams, moco: MocoParams, augment: AugmentParams,
                     opt: PretrainParams, world_size: int) -> dict[str, Any]:
    """The params that decide the trained weights (the checkpoint fingerprint's input)."""
    return {"seed": seed, "model": asdict(model), "moco": asdict(moco),
            "augment": asdict(augment), "world_size": world_size,
            "pretrain": {k: v for k, v in asdict(opt).items() if k not in NOT_FINGERPRINTED}}


def _setup_threads(saved: int, opt: PretrainParams, net: MoCo, plan: RunPlan,
                   rt: Runtime) -> int:
    """CPU intra-op threads: ``pretrain.num_threads``, else the resumed run's, else probed."""
    if opt.num_threads > 0 or saved > 0:
        n = opt.num_threads or saved
        if n > usable_cores():
            log.warning("pretrain.num_threads = %d exceeds the %d usable cores: threads will "
                        "compete for them", n, usable_cores())
        torch.set_num_threads(n)
        return n
    if rt.device.type == "cuda":
        return torch.get_num_threads()
    probe_net = copy.deepcopy(net.encoder_q).train()
    shape = (plan.per_rank_batch, plan.channels, plan.image_size, plan.image_size)
    with torch.random.fork_rng(devices=[]):
        x = torch.randn(shape)

        def probe() -> None:
            probe_net(x).sum().backward()

        n = choose_threads(thread_candidates(opt.num_workers), probe)
    log.info("CPU threads: %d (pretrain.num_threads = 0: probed %s)", n,
             thread_candidates(opt.num_workers))
    return n


class _Run:
    """One pretraining run's collaborators, wired by :func:`pretrain`; ``epoch`` is the loop."""

    def __init__(self, **parts: Any) -> None:
        self.__dict__.update(parts)

    def record_monitor(self, epoch: int) -> None:
        if not (self.rt.is_main and self.monitor.due(epoch)):
            return
        res = self.monitor(self.net.encoder_q.backbone)
        self.state.knn_rows.append({"epoch": epoch, "step": epoch * self.plan.steps_per_epoch,
                                    **res})
        if self.run is not None:
            self.run.log_metrics({f"monitor_{k}": v for k, v in res.items()},
                                 step=epoch * self.plan.steps_per_epoch)

    def save(self) -> None:
        self.ckpt.save(self.net, self.optimizer, self.precision.scaler, self.state)
        self.saved_step = self.state.step

    def worker_died(self, died: LoaderWorkerError) -> BaseException:
        """The one-line failure for a dead loader worker, with the step to resume from.

        Between two steps (the usual case: the death surfaces while a batch is awaited) the
        state is whole, so a checkpoint is written at the current step; inside a step the last
        one stands. When this process also received SIGTERM/SIGINT (a signal to the whole
        process group reaches the worker first), it is that signal's :class:`Terminated`.
        """
        if not self.in_step:
            self.save()
            where = f"checkpoint written at step {self.state.step} to {self.ckpt.path}"
        elif self.saved_step is not None:
            where = f"the last checkpoint is at step {self.saved_step} ({self.ckpt.path})"
        else:
            where = "no checkpoint was written yet"
        if self.stop.raised:
            name = signal.Signals(self.stop.signum).name
            return Terminated(f"{name}: {where} (a DataLoader worker was killed by "
                              f"{died.signal_name} first)", signum=self.stop.signum)
        return died.with_where(f"{where}; rerun to resume from it")

    def epoch(self, epoch: int, stop_at: int) -> None:
        """Steps of ``epoch`` from the current step (a resumed epoch skips what was done)."""
        spe, state = self.plan.steps_per_epoch, self.state
        loader = train_loader(self.shards_dir / "pretrain", batch_size=self.plan.per_rank_batch,
                              steps=spe, epoch=epoch, seed=self.seed, rank=self.rt.rank,
                              world_size=self.rt.world_size, num_workers=self.opt.num_workers,
                              skip_batches=state.step - epoch * spe,
                              pin_memory=self.rt.device.type == "cuda", crop=self.crop)
        self.net.train()
        window = LogWindow(self.opt.batch_size)
        batches = iter(loader)
        while state.step < min((epoch + 1) * spe, stop_at):
            t_wait = time.time()
            images, _ = next(batches)
            self.in_step = True  # from here to the step's end the state is not whole
            wait_s = time.time() - t_wait
            images = images.to(self.rt.device, non_blocking=True)
            out = self.step(images, epoch)
            state.step += 1
            window.add(loss=out.loss.item(), top1=float(out.top1), top5=float(out.top5),
                       wait_s=wait_s)
            self.after_step(window, out)
            self.in_step = False

    def step(self, images: torch.Tensor, epoch: int) -> MocoOutput:
        s = self.state.step
        try:
            return train_step(self.ddp_net, images, views=self.views,
                              aug_seed=batch_seed(self.seed, epoch, s, self.rt.rank),
                              optimizer=self.optimizer, precision=self.precision,
                              lr=self.plan.lrs[s], m=self.plan.momenta[s], step=s)
        except NonFiniteLossError as e:
            kept = (f"the last good checkpoint is kept at {self.ckpt.path}"
                    if self.ckpt.path.is_file() else "no checkpoint was written yet")
            raise NonFiniteLossError(f"{e} (epoch {epoch}); training stopped, {kept}. Lower "
                                     "pretrain.lr or check the data") from None

    def after_step(self, window: LogWindow, out: MocoOutput) -> None:
        """Progress, logging window, epoch-end monitor, stop signals, checkpoint cadence."""
        s, spe, total = self.state.step, self.plan.steps_per_epoch, self.plan.total_steps
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{out.loss.item():.3f}")
        if s % self.opt.log_every_steps == 0 or s == total:
            row = window.row(step=s, steps_per_epoch=spe, lr=self.plan.lrs[s - 1],
                             m=self.plan.momenta[s - 1],
                             queue_mean_age=float(self.net.queue.mean_age(s)))
            self.state.rows.append(row)
            if self.run is not None:
                self.run.log_metrics({k: v for k, v in row.items() if k != "step"}, step=s)
            if self.bar is None and self.rt.is_main:
                log.info(format_row(row, total))
        if s % spe == 0:
            self.record_monitor(s // spe)
        if self.stop.raised:
            self.save()
            name = signal.Signals(self.stop.signum).name
            raise Terminated(f"{name}: checkpoint written at step {s} to {self.ckpt.path}",
                             signum=self.stop.signum)
        if self.policy.due(s):
            self.save()


def pretrain(*, model: ModelParams, moco: MocoParams, opt: PretrainParams, augment: AugmentParams,
             seed: int, shards_dir: Path, encoder_path: Path,
             checkpoint_dir: Path | Callable[[str], Path], metrics_path: Path,
             plots_path: Path, knn_plots_path: Path,
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
        checkpoint_dir: ``last.pt`` lives here (resume state, outside DVC's outputs), or a
            function of the run's fingerprint returning that folder (the stage's resume store,
            :func:`pipeline.train.resume_store.open_entry`).
        metrics_path: final metrics JSON (``metrics/pretrain.json``).
        plots_path: per-logged-step TSV (``plots/pretrain.tsv``).
        knn_plots_path: kNN-monitor TSV per epoch (``plots/knn_monitor.tsv``).
        run: MLflow handle (rank 0) or None.
        max_steps: stop after this global step (tests simulate an interruption with it).

    Returns:
        The final metrics (also written to ``metrics_path``).

    Raises:
        ValueError: sizes that do not fit the data or the processes (names the param).
        NonFiniteLossError: the loss became NaN/inf (the last good checkpoint is kept).
        Terminated: SIGTERM or SIGINT was received (a checkpoint was written first).
        LoaderWorkerError: a DataLoader worker died (e.g. SIGKILL from the out-of-memory
            killer); the message names the signal and the checkpoint step to resume from.
    """
    threads_before = torch.get_num_threads()
    try:
        return _pretrain(model=model, moco=moco, opt=opt, augment=augment, seed=seed,
                         shards_dir=shards_dir, encoder_path=encoder_path,
                         checkpoint_dir=checkpoint_dir, metrics_path=metrics_path,
                         plots_path=plots_path, knn_plots_path=knn_plots_path, run=run,
                         max_steps=max_steps)
    finally:
        torch.set_num_threads(threads_before)  # the probe's choice is this run's only


def _pretrain(*, model: ModelParams, moco: MocoParams, opt: PretrainParams,
              augment: AugmentParams, seed: int, shards_dir: Path, encoder_path: Path,
              checkpoint_dir: Path | Callable[[str], Path], metrics_path: Path,
              plots_path: Path, knn_plots_path: Path,
              run: StageRun | None, max_steps: int | None) -> dict[str, float]:
    """:func:`pretrain`'s body: wire the parts, run the epochs, finish."""
    rt = setup_device()
    manifest = read_manifest(shards_dir / "pretrain")
    plan = plan_run(manifest, shards_dir / "pretrain", opt=opt, moco=moco, rt=rt)
    configure_determinism(opt.deterministic, rt.device)
    torch.manual_seed(seed)
    net = build_moco(model, moco, in_channels=plan.channels, image_size=plan.image_size,
                     world_size=rt.world_size).to(rt.device)
    precision = Precision(resolve_precision(opt.precision, rt.device), rt.device)
    optimizer = torch.optim.SGD(net.trainable_parameters(), lr=0.0, momentum=opt.sgd_momentum,
                                weight_decay=opt.weight_decay)
    params = _training_params(seed, model, moco, augment, opt, rt.world_size)
    fp = fingerprint(params, [s["sha256"] for s in manifest["shards"]])
    ckpt_dir = checkpoint_dir(fp) if callable(checkpoint_dir) else checkpoint_dir
    ckpt = Checkpointer(ckpt_dir / "last.pt", fp, params, rt.is_main)
    state = ckpt.restore(net, optimizer, precision.scaler)
    state.num_threads = _setup_threads(state.num_threads, opt, net, plan, rt)
    channels_last = resolve_switch(opt.channels_last, cpu_default=False,
                                   device=rt.device)
    compile_ = resolve_compile(opt.compile, device=rt.device, width=model.width,
                               total_images=plan.total_steps * opt.batch_size)
    log.info("pretrain: %s, %s, %d threads, channels_last %s, compile %s, %d steps",
             rt.device, precision.name, state.num_threads, channels_last, compile_,
             plan.total_steps)
    r = _Run(rt=rt, plan=plan, opt=opt, seed=seed, shards_dir=shards_dir, run=run, net=net,
             ddp_net=wrap_model(net, rt, channels_last=channels_last, compile_=compile_),
             precision=precision, optimizer=optimizer, ckpt=ckpt, state=state,
             crop=RandomResizedCrop(plan.image_size, scale=(augment.crop_min_scale, 1.0))
             if plan.crop_in_loader else None,
             views=BatchTwoCrop(build_batch_view(augment.preset, plan.image_size, plan.mean,
                                                 plan.std, augment.crop_min_scale,
                                                 crop=not plan.crop_in_loader).to(rt.device),
                                torch.channels_last if channels_last else torch.contiguous_format),
             monitor=KnnMonitor(shards_dir, transform=aug.build_eval_transform(
                 plan.image_size, plan.mean, plan.std), device=rt.device,
                 n_train=opt.knn_monitor_train_images, n_test=opt.knn_monitor_test_images,
                 every_epochs=opt.knn_every_epochs),
             policy=CheckpointPolicy(opt.checkpoint_every_epochs, opt.checkpoint_every_steps,
                                     plan.total_steps, plan.steps_per_epoch), bar=None,
             in_step=False, saved_step=state.step or None)
    stop_at = plan.total_steps if max_steps is None else min(max_steps, plan.total_steps)
    if state.step == 0 and not state.knn_rows:
        r.record_monitor(0)  # the random-init encoder: the curve's starting point
    with stop_on_signals() as r.stop, _progress(rt, plan.total_steps, state.step) as r.bar:
        try:
            while state.step < stop_at:
                r.epoch(state.step // plan.steps_per_epoch, stop_at)
        except RuntimeError as e:  # PyTorch's SIGCHLD handler raises at any line
            died = worker_death(e)
            if died is None:
                raise
            raise r.worker_died(died) from None
    if state.step < plan.total_steps:  # stopped early by max_steps (tests)
        return {"step": float(state.step)}
    return _finish(r, model, encoder_path, metrics_path, plots_path, knn_plots_path)


class _progress:
    """A tqdm bar on rank 0 when stderr is a terminal, else None (log lines instead)."""

    def __init__(self, rt: Runtime, total: int, initial: int) -> None:
        self.bar = None
        if rt.is_main and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="pretrain", unit="step")

    def __enter__(self) -> Any:
        return self.bar

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _finish(r: _Run, model: ModelParams, encoder_path: Path, metrics_path: Path,
            plots_path: Path, knn_plots_path: Path) -> dict[str, float]:
    """Final metrics; rank 0 exports; all ranks check their queues agree (DDP)."""
    metrics = final_metrics(r.state, total_steps=r.plan.total_steps, epochs=r.opt.epochs,
                            wall_s=r.ckpt.wall_time(r.state), device=r.rt.device,
                            world_size=r.rt.world_size)
    if r.rt.world_size > 1:
        metrics["queue_ranks_identical"] = int(_queues_identical(r.net))
    if r.rt.is_main:
        export_outputs(r.net, model, in_channels=r.plan.channels, image_size=r.plan.image_size,
                       state=r.state, metrics=metrics, encoder_path=encoder_path,
                       metrics_path=metrics_path, plots_path=plots_path,
                       knn_plots_path=knn_plots_path)
        if r.run is not None:
            r.run.log_metrics({f"final_{k}": v for k, v in metrics.items()})
    if r.rt.world_size > 1:
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
